"""Fake of A1111 modules/script_callbacks.py: registration functions and the host's calls of them."""

callbacks = {"list_optimizers": [], "ui_settings": [], "model_loaded": [], "script_unloaded": []}


def clear_callbacks():
    for registered in callbacks.values():
        registered.clear()


def on_list_optimizers(callback, *, name=None):
    callbacks["list_optimizers"].append(callback)


def on_ui_settings(callback, *, name=None):
    callbacks["ui_settings"].append(callback)


def on_model_loaded(callback, *, name=None):
    callbacks["model_loaded"].append(callback)


def on_script_unloaded(callback, *, name=None):
    callbacks["script_unloaded"].append(callback)


def list_optimizers_callback():
    found = []
    for callback in callbacks["list_optimizers"]:
        callback(found)
    return found


def ui_settings_callback():
    for callback in callbacks["ui_settings"]:
        callback()


def model_loaded_callback(sd_model):
    for callback in callbacks["model_loaded"]:
        callback(sd_model)


def script_unloaded_callback():
    for callback in reversed(callbacks["script_unloaded"]):
        callback()
