"""Recurrent-state layers' states: their slots (:mod:`~pagedkv.state.slots`), the
snapshots kept for prefix hits (:mod:`~pagedkv.state.snapshots`), each sequence's state
through its life (:mod:`~pagedkv.state.tables`) and the tensors that hold them
(:mod:`~pagedkv.state.store`). The group's spec is
:class:`pagedkv.groups.spec.RecurrentStateSpec`."""
