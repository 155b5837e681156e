"""Fake of A1111 modules/options.py: OptionInfo's constructor and Options' attribute access,
add_option and set (which calls the option's onchange)."""


class OptionInfo:
    def __init__(self, default=None, label="", component=None, component_args=None, onchange=None, section=None,
                 refresh=None, comment_before="", comment_after="", infotext=None, restrict_api=False, category_id=None):
        self.default = default
        self.label = label
        self.component = component
        self.component_args = component_args
        self.onchange = onchange
        self.section = section
        self.comment_after = comment_after

    def info(self, info):
        self.comment_after += f"<span class='info'>({info})</span>"
        return self


class Options:
    def __init__(self, data_labels):
        object.__setattr__(self, "data_labels", dict(data_labels))
        object.__setattr__(self, "data", {key: info.default for key, info in data_labels.items()})

    def __getattr__(self, item):
        if item in self.data:
            return self.data[item]
        if item in self.data_labels:
            return self.data_labels[item].default
        raise AttributeError(item)

    def __setattr__(self, key, value):
        if key in self.data or key in self.data_labels:
            self.data[key] = value
        else:
            object.__setattr__(self, key, value)

    def add_option(self, key, info):
        self.data_labels[key] = info
        if key not in self.data:
            self.data[key] = info.default

    def set(self, key, value):
        old = self.data.get(key)
        if old == value:
            return False
        setattr(self, key, value)
        onchange = self.data_labels[key].onchange
        if onchange is not None:
            try:
                onchange()
            except Exception:
                setattr(self, key, old)
                return False
        return True
