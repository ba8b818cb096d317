"""The torch and transformers internals memfit relies on, in one place.

memfit models what PyTorch does below its public API, so it uses some private names. Each one
that memfit *patches*, *walks* or *calls* lives behind a small function in
:mod:`memfit._compat.torch_internals` (the patches of DTensor, FSDP2 and the pipeline schedules
in :mod:`~memfit._compat.torch_dtensor`, :mod:`~memfit._compat.torch_fsdp` and
:mod:`~memfit._compat.torch_pipelining`) or :mod:`memfit._compat.transformers_internals`, with a
docstring naming the internal, the versions it was checked against and the source it mirrors.
Private *imports* that other modules make directly (``FakeTensorMode``, ``TorchDispatchMode``,
...) are listed in :data:`memfit._compat.torch_internals.PRIVATE_NAMES`.

``tests/test_compat.py`` checks each against the installed torch / transformers (and fails with
a message naming the internal and what changed), and scans ``src/memfit`` so that a new private
name used anywhere else must be registered here first.
"""
