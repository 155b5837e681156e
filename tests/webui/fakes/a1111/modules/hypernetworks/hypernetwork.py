"""Fake of A1111 modules/hypernetworks/hypernetwork.py's apply_hypernetworks: each loaded
hypernetwork maps the context (by its width) through a (key layer, value layer) pair."""


def apply_hypernetworks(hypernetworks, context, layer=None):
    context_k = context_v = context
    for hypernetwork in hypernetworks:
        layers = hypernetwork.layers.get(context.shape[2])
        if layers is not None:
            context_k, context_v = layers[0](context_k), layers[1](context_v)
    return context_k, context_v
