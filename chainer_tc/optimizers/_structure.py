"""Whether a model still has the links and parameters it had: cheap enough to ask every step.

Chainer's optimizers find a model's parameters by walking it at every update, so a link added,
deleted or replaced after ``setup()`` is seen at the next one. The batched optimizer and the
step replay keep what they found instead; this snapshot lets them notice such a change at the
cost of identity tests (about 13 us for the 161 parameters and 125 links of ResNet-50, against
75 us for walking ``model.params()``).

Every way Chainer 7 changes a model's structure goes through a link's ``__dict__`` and its
``_params`` / ``_children`` containers (``init_scope`` assignments, ``add_param``, ``add_link``,
``del``, ``ChainList.append`` / ``insert`` / ``__setitem__`` / ``__delitem__``): the snapshot
holds the object under every name and index, and each container's length.
"""


class Structure:
    """The links and parameters under ``roots`` now; :meth:`same` says whether that still
    holds. A False may come from a change that leaves the set of parameters as it was (a
    parameterless link replaced, two links swapped)."""

    def __init__(self, *roots):
        self.roots = roots
        held = []          # (container, key, object): container[key] must still be object
        sizes = []         # (container, length)
        links = {id(link): link for root in roots for link in root.links()}
        for link in links.values():
            d = link.__dict__
            params = d['_params']
            held.append((d, '_params', params))
            sizes.append((params, len(params)))
            held.extend((d, name, d[name]) for name in params)
            children = d.get('_children')
            if children is None:
                continue
            held.append((d, '_children', children))
            sizes.append((children, len(children)))
            if isinstance(children, list):              # ChainList: the links themselves
                held.extend((children, i, child) for i, child in enumerate(children))
            else:                                       # Chain: their names
                held.extend((d, name, d[name]) for name in children)
        self._held = held
        self._sizes = sizes

    def same(self):
        try:
            for container, key, obj in self._held:
                if container[key] is not obj:
                    return False
        except (KeyError, IndexError):
            return False
        for container, n in self._sizes:
            if len(container) != n:
                return False
        return True
