"""The dispatch: for each attention call, the kernels or the fallback, and why.

planner (every check of a call, once, into a frozen plan or a refusal), router (the entry points, which
run a plan: the kernels, counted, or the fallback), state (the one object holding what the layer
learns: per-device verdicts, plans per call signature, counters), selftest (the first-use check of the
kernels on a device, whose verdict the planner asks for), sdpa_patch (the process-wide override of
torch's scaled_dot_product_attention).
"""
