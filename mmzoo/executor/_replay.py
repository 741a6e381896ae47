"""Replaying a compiled XLA graph without tracing it again.

torch_xla's lazy tensors rebuild the IR graph of a step in Python on every call, then hash it to
find the compiled executable. For a small model's decode step that rebuilding can cost more than
running the graph (docs/benchmarks.md has the figures). A :class:`ReplayedStep` traces the step once, keeps the compiled
graph's hash and the order of its parameters, and from then on calls the executable directly with
the new inputs (the mechanism torch_xla's dynamo bridge uses, without dynamo).

The step may update some tensors in place (the KV cache, the media buffer): those are ``state``. Their buffers are
donated to the graph, so XLA writes the new values over the old ones, and the caller gets the new
tensors back to hold from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class ReplayedStep:
    """A device step ``fn(inputs, state) -> outputs`` traced once, then run as its compiled graph.

    Args:
        fn: the step, ``fn(inputs, state) -> outputs``; builds its graph from ``inputs``, the
            tensors in ``state`` (updated in place) and any other device tensors it reads
            (weights: they become constants of the replay, so they must not change afterwards).
        inputs: example per-call tensors, on the XLA device and materialized; each call passes
            tensors of the same shapes and dtypes in the same order.
        state: tensors ``fn`` updates in place (materialized).

    Calling it with new inputs and the current state returns ``(outputs, new_state)``; the
    passed state tensors are donated and must not be used again.
    """

    def __init__(self, fn: Callable[[Sequence[torch.Tensor], list[torch.Tensor]], Sequence[torch.Tensor]],
                 inputs: Sequence[torch.Tensor], state: Sequence[torch.Tensor]):
        import torch_xla

        C = torch_xla._XLAC

        torch_xla.sync()
        if any(C._check_tensor_need_materialization(list(inputs) + list(state))):
            raise ValueError("ReplayedStep: inputs and state must be materialized device data")
        self.signature = [(tuple(t.shape), t.dtype) for t in inputs]
        self.state_signature = [(tuple(t.shape), t.dtype) for t in state]
        # trace on copies of the state: the traced in-place updates are dropped below, unrun,
        # which would leave the real state without a value
        state = [t.clone() for t in state]
        torch_xla.sync()
        input_ids = {C._xla_get_tensor_id(t): i for i, t in enumerate(inputs)}
        state_ids = {C._xla_get_tensor_id(t): i for i, t in enumerate(state)}
        for t in state:
            C._set_buffer_donation(t, True)
        outputs = list(fn(inputs, state))
        # XLA pairs the donated parameters with the outputs of their shape in order, so the updated
        # state must come out in the order its parameters go in (else each updated cache tensor is
        # paired with another one's buffer, and XLA copies every one of them on every step). The
        # parameters are numbered as the graph is walked from its roots, so reorder until stable.
        self.order = list(range(len(state)))
        for _ in range(len(state) + 1):
            roots = [state[i] for i in self.order] + outputs  # the state holds its new value as pending IR
            graph_ids, graph_values = C._get_tensors_xla_device_data_node(roots)
            where = {tid: j for j, tid in enumerate(graph_ids)}
            first = {i: where[tid] for tid, i in state_ids.items() if tid in where}  # state i -> its parameter
            missing = sorted(set(range(len(state))) - set(first))
            if missing:
                raise ValueError(f"ReplayedStep: the step does not read state tensors {missing}")
            by_param = sorted(range(len(state)), key=first.__getitem__)
            if by_param == self.order:
                break
            self.order = by_param
        else:
            raise ValueError("ReplayedStep: no order of the state matches its parameters")
        if C._get_seed_info_id() in graph_ids:
            C._clear_pending_irs(str(torch_xla.device()))
            raise ValueError("ReplayedStep: the step draws from torch's XLA random generator; pass random draws as inputs")
        # each graph parameter: ("input", i), ("state", i) or a constant captured now (weights, scalars)
        self.params: list[tuple[str, int] | torch.Tensor] = []
        for tid, value in zip(graph_ids, graph_values):
            if tid in input_ids:
                self.params.append(("input", input_ids[tid]))
            elif tid in state_ids:
                self.params.append(("state", state_ids[tid]))
            else:
                self.params.append(value)
        before = C._xla_get_enable_alias_with_buffer_donor_config()
        C._xla_set_enable_alias_with_buffer_donor_config(True)  # alias the donated state to its new value
        try:
            self.graph_hash = C._get_graph_hash(roots)
            C._xla_warm_up_cache(roots, [])  # compiles (or finds) the executable; runs nothing
        finally:
            C._xla_set_enable_alias_with_buffer_donor_config(before)
        C._clear_pending_irs(str(torch_xla.device()))  # drop the traced IR without running it
        self._C = C

    def __call__(self, inputs: Sequence[torch.Tensor], state: Sequence[torch.Tensor]):
        """Run the graph on ``inputs`` and ``state``; returns ``(outputs, new_state)`` (lists)."""
        C = self._C
        sig = [(tuple(t.shape), t.dtype) for t in inputs]
        if sig != self.signature:
            raise ValueError(f"ReplayedStep: inputs {sig} differ from the traced {self.signature}")
        if len(state) != len(self.state_signature):
            raise ValueError(f"ReplayedStep: {len(state)} state tensors; traced with {len(self.state_signature)}")
        pending = C._check_tensor_need_materialization(list(inputs) + list(state))
        if any(pending):  # e.g. an input converted on the device, not yet run
            import torch_xla

            torch_xla.sync()
        for t in state:
            C._set_buffer_donation(t, True)
        args = [(inputs if p[0] == "input" else state)[p[1]] if isinstance(p, tuple) else p for p in self.params]
        res = C._run_cached_graph(self.graph_hash, args)
        n = len(state)
        new_state: list = [None] * n
        for j, i in enumerate(self.order):
            new_state[i] = res[j]
        return list(res[n:]), new_state
