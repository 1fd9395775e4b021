"""Pipeline executor: one pp rank runs its stages of the program over microbatches, by schedule.

The compiler hands an orchestrator GraphModule whose ``submod_k`` are the ``pp * v`` stages; stage
``s`` runs on pp rank ``s % pp`` (Megatron's looping assignment, so with ``v > 1`` rank r holds
chunks r, r + pp, ...). From the orchestrator this module reads, as plain data, what each stage
takes (program inputs, or outputs of earlier stages) and where its outputs go. A rank then follows
its list of schedule actions: F(s, m) receives stage s's inputs of microbatch m from the stages that
make them, runs the stage and sends its outputs on; B(s, m) receives the gradients of those
outputs, runs backward and sends the gradients of what it received back. Zero-bubble schedules
split B into I (the input gradients only, sent back at once: the critical path) and W (the weight
gradients, later, from the graph I kept) -- Qi et al. 2024, "Zero Bubble Pipeline Parallelism".

Messages. Every transfer is one (producer stage, consumer stage, output index) "kind", in one
direction, for one microbatch. No tags (NCCL has none): messages between one pair of ranks match in
post order, and a rank receives from each peer in the order that peer posts (``posting_orders``,
derived by both from the schedule), keeping messages it needs later. A transfer between two stages
of the same rank stays in memory. A rank's sends wait in an outbox and are posted in one batch
(``batch_isend_irecv``: one NCCL group call) with its next receive -- Megatron's
send_forward_recv_backward -- or at the end of the step; a rank never blocks while holding unsent
messages, so the order the schedule checker proved deadlock free stays so.

The loss: each microbatch's backward starts from its token *sum* (loss x count); after the last
microbatch every gradient is divided by the global count N, so the step equals the global token
mean on one device (the counts come from passes/loss_count.py).
"""

from __future__ import annotations

import contextlib

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .loss_value import loss_parts, microbatch_share, step_count
from .training import counted_once
from .pipeline_backward import WeightWork, input_grads, weight_grads


@dataclass
class StageSpec:
    """What stage k takes and gives. Sources: ("input", placeholder) or ("stage", j, output index)."""

    index: int
    module: str
    sources: list[tuple] = field(default_factory=list)
    outputs: list[tuple[tuple[int, ...], torch.dtype, bool]] = field(default_factory=list)  # shape, dtype, grad
    consumers: dict[int, list[int]] = field(default_factory=dict)  # output index -> consumer stages


def stage_specs(top: fx.GraphModule, local_shape) -> list[StageSpec]:
    """Read the orchestrator graph. local_shape(inner_node) -> this rank's shape of a stage output."""
    specs, by_node = [], {}
    for node in top.graph.nodes:
        if node.op != "call_module":
            continue
        spec = StageSpec(len(specs), node.target)
        for arg in node.args:
            spec.sources.append(_source(arg, by_node))
        stage = top.get_submodule(node.target)
        spec.outputs = [(local_shape(n), n.meta["val"].dtype, _needs_grad(n)) for n in _outputs(stage)]
        by_node[node] = spec
        specs.append(spec)
    for spec in specs:
        for source in spec.sources:
            if source[0] == "stage":
                specs[source[1]].consumers.setdefault(source[2], []).append(spec.index)
    return specs


def held_inputs(top: fx.GraphModule, pp: int, rank: int) -> set[str]:
    """Names of the program inputs (state and batch) that the stages of pp rank ``rank`` take: a
    pipeline rank keeps only these parameters, their gradients and optimizer state."""
    stages = [n for n in top.graph.nodes if n.op == "call_module"]
    held = {arg.name for k, node in enumerate(stages) if k % pp == rank
            for arg in node.args if isinstance(arg, fx.Node) and arg.op == "placeholder"}
    if rank == 0:  # state no stage reads (an unused parameter or buffer) is kept by the first rank
        held |= {n.name for n in top.graph.nodes if n.op == "placeholder" and not n.users}
    return held


def deferred_inputs(top: fx.GraphModule, pp: int, rank: int) -> set[str]:
    """Names of the program inputs whose gradient is final only at the step's end on pp rank ``rank``:
    taken by stages on two ranks (their sum over pp comes first: a tied embedding and head) or by
    two of this rank's stages (interleaved). Their dp reduction is launched by the reducer's finish,
    not from a hook, in buckets of their own so the other weights' buckets still go from backward."""
    stages = [n for n in top.graph.nodes if n.op == "call_module"]
    users: dict[str, list[int]] = {}
    for k, node in enumerate(stages):
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg.op == "placeholder":
                users.setdefault(arg.name, []).append(k % pp)
    return {name for name, ranks in users.items() if len(set(ranks)) > 1 or ranks.count(rank) > 1}


def _outputs(stage: fx.GraphModule) -> list[fx.Node]:
    out = next(n for n in stage.graph.nodes if n.op == "output").args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _needs_grad(node: fx.Node) -> bool:
    ann = node.meta.get("usc")
    return bool(ann is not None and ann.needs_grad)


def _source(arg: fx.Node, by_node: dict) -> tuple:
    if arg.op == "placeholder":
        return ("input", arg.name)
    if arg.op == "call_function" and arg.target is operator.getitem:
        return ("stage", by_node[arg.args[0]].index, arg.args[1])
    return ("stage", by_node[arg].index, 0)


def messages_from(specs: list[StageSpec], producer: int, consumer: int) -> list[int]:
    """Output indices of ``producer`` that ``consumer`` receives, in the one order both sides use."""
    return sorted(i for i, users in specs[producer].consumers.items() if consumer in users)


def consumers_of(specs: list[StageSpec], producer: int) -> list[int]:
    return sorted({c for users in specs[producer].consumers.values() for c in users})


Kind = tuple[int, int, int]  # (producer stage, consumer stage, producer output index)
FORWARD, BACKWARD = 0, 1


def message_kinds(specs: list[StageSpec]) -> list[Kind]:
    """Every activation that crosses a cut, in one order all ranks agree on."""
    return [(p, c, i) for p in range(len(specs)) for c in consumers_of(specs, p) for i in messages_from(specs, p, c)]


def carries_gradient(specs: list[StageSpec], kind: Kind) -> bool:
    _, dtype, needs = specs[kind[0]].outputs[kind[2]]
    return needs and dtype.is_floating_point


Message = tuple[int, Kind, int]  # (direction, kind, microbatch)


def _receiver_stage(message: Message) -> int:
    direction, (producer, consumer, _), _ = message
    return consumer if direction == FORWARD else producer


def _messages_of(specs: list[StageSpec], kinds: list[Kind], op: str, stage: int, mb: int) -> tuple[list, list]:
    """(received, sent) messages of one compute action, each in the order the executor posts them."""
    into = [k for k in kinds if k[1] == stage]  # producer, then output index: _forward's order
    out_of = [k for k in kinds if k[0] == stage]  # consumer, then output index
    if op == "F":
        return [(FORWARD, k, mb) for k in into], [(FORWARD, k, mb) for k in out_of]
    if op in ("B", "I"):
        grads_in = [(BACKWARD, k, mb) for k in out_of if carries_gradient(specs, k)]
        grads_out = [(BACKWARD, k, mb) for k in sorted(into, key=lambda k: (k[0], k[2])) if carries_gradient(specs, k)]
        return grads_in, grads_out
    return [], []


def posting_orders(specs: list[StageSpec], actions: dict[int, tuple], pp: int, *, train: bool) -> dict:
    """(sender rank, receiver rank) -> the messages the sender posts to the receiver, in its order.

    This is the one total order per rank pair both sides agree on: a receiver takes its messages
    in this order (keeping the ones it needs later), so a backend that matches point-to-point
    messages by post order alone (NCCL) pairs them right too. Sends never block, so every message
    before the one a receiver waits for has been posted already: following the order adds no wait
    that could deadlock."""
    kinds = message_kinds(specs)
    orders: dict[tuple[int, int], list[Message]] = {}
    for rank, acts in actions.items():
        for act in acts:
            if train or act.op.value == "F":
                for message in _messages_of(specs, kinds, act.op.value, act.stage, act.mb)[1]:
                    peer = _receiver_stage(message) % pp
                    if peer != rank:
                        orders.setdefault((rank, peer), []).append(message)
    return orders


@dataclass
class InFlight:
    """What one microbatch's forward left for its backward on one stage."""

    received: dict[tuple[int, int], torch.Tensor]
    outputs: list[torch.Tensor]
    count: torch.Tensor | float = 1.0  # the loss's token count (a device tensor when the program gives it)
    share: torch.Tensor | None = None  # the last stage's part of the step's loss sum (runtime/loss_value.py)
    weight_work: WeightWork | None = None  # what W still owes after I


class PipelineMixin:
    """Stage execution for RankExecutor (see the module docstring); mixed in by PipelineExecutor."""

    def _setup_pipeline(self, schedule) -> None:
        top = self.gm
        mesh_spec = self.program.mesh
        self.specs = stage_specs(top, lambda n: n.meta["usc"].layout.local_shape(tuple(n.meta["val"].shape),
                                                                                  mesh_spec))
        self.pp = self.mesh.comm("pp")
        self.pp_rank, self.pp_size = self.mesh.coord_of("pp"), self.pp.size
        if len(self.specs) != schedule.stages or schedule.pp != self.pp_size:
            raise ValueError(f"the program has {len(self.specs)} stages on pp={self.pp_size}, the schedule "
                             f"{schedule.name} expects {schedule.stages} on pp={schedule.pp}")
        self.modules = {s: top.get_submodule(self.specs[s].module) for s in range(len(self.specs))
                        if self._rank_of(s) == self.pp_rank}
        self.actions = list(schedule.actions[self.pp_rank])
        self.kinds = {kind: n for n, kind in enumerate(message_kinds(self.specs))}
        self._outbox: list[tuple[torch.Tensor, int]] = []  # (tensor, peer): posted with the next receive
        self._pending: list = []  # Works of posted sends not yet finished, all waited for at the end of the step
        self._local: dict = {}  # transfers between two stages of this rank
        users: dict[str, set[int]] = {}
        for spec in self.specs:
            for source in spec.sources:
                if source[0] == "input":
                    users.setdefault(source[1], set()).add(spec.index)
        self.owner = {name: self._rank_of(min(stages)) for name, stages in users.items()}
        self.state_specs = {s.placeholder: s for s in self.program.state}
        trainable = {s.placeholder for s in self.program.state if s.kind == "param" and s.trainable}
        self.shared = sorted(name for name, stages in users.items()
                             if len({self._rank_of(s) for s in stages}) > 1 and name in trainable)
        self.stage_params = {s: [self.state[x[1]] for x in self.specs[s].sources
                                 if x[0] == "input" and self._is_param(x[1]) and self.state[x[1]].requires_grad]
                             for s in self.modules}
        self._orders = {train: {src: order for (src, dst), order in
                                posting_orders(self.specs, schedule.actions, self.pp_size, train=train).items()
                                if dst == self.pp_rank} for train in (True, False)}
        self._inbox: dict[int, list] = {}  # peer -> messages still to take, in its posting order
        self._early: dict[Message, torch.Tensor] = {}  # taken before they were needed
        # The gradient reduction over dp overlaps the pipeline: a stage's last backward action runs
        # with the reducer's hooks on, so each bucket is launched as soon as its gradients are final,
        # while later layers (and the other stages) still compute. The weights whose gradient is final
        # only at the step's end (``deferred_inputs``) sit in buckets of their own, which the
        # reducer's finish launches (the executor built it so).
        self._final_backward = {}
        for index, action in enumerate(self.actions):
            if action.op.value in ("B", "W"):
                self._final_backward[action.stage] = index

    def _holds(self, spec) -> bool:
        return spec.placeholder in self._held

    def _is_param(self, name: str) -> bool:
        return name in self.state and isinstance(self.state[name], torch.nn.Parameter)

    def _rank_of(self, stage: int) -> int:
        return stage % self.pp_size

    @property
    def _last_stage(self) -> int:
        return len(self.specs) - 1

    @property
    def _last(self) -> bool:
        """This rank holds the last stage (the loss)."""
        return self._rank_of(self._last_stage) == self.pp_rank

    # ----------------------------------------------------------------------------- transfers
    def _put(self, kind: Kind, direction: int, mb: int, t: torch.Tensor) -> None:
        """Sends never block the schedule (a blocking send to a stage that is itself sending would
        deadlock 1F1B): queued here, posted with this rank's next receive (see the module doc)."""
        to_stage = kind[1] if direction == FORWARD else kind[0]
        peer = self._rank_of(to_stage)
        if peer == self.pp_rank:
            self._local[(kind, direction, mb)] = t
            return
        self._outbox.append((t, peer))

    def _get(self, kind: Kind, direction: int, mb: int) -> torch.Tensor:
        from_stage = kind[0] if direction == FORWARD else kind[1]
        peer = self._rank_of(from_stage)
        if peer == self.pp_rank:
            return self._local.pop((kind, direction, mb))
        wanted = (direction, kind, mb)
        while wanted not in self._early:  # take the peer's messages in its order (see posting_orders)
            message = self._inbox[peer].pop(0)
            self._early[message] = self._recv(message, peer)
        return self._early.pop(wanted)

    def _recv(self, message: Message, peer: int) -> torch.Tensor:
        """One message, received in one batch with every queued send."""
        direction, kind, mb = message
        shape, dtype, _ = self.specs[kind[0]].outputs[kind[2]]
        like = torch.empty(shape, dtype=self._wire(dtype), device=self.device)
        return self._post([(like, peer)])[0]

    def _post(self, recvs: list) -> list[torch.Tensor]:
        sends, self._outbox = self._outbox, []
        if not sends and not recvs:
            return []
        received, sent = self.pp.batch_p2p(sends, recvs)
        # a finished send's buffer is freed now, not at the end of the step (held, every
        # microbatch's sent activations and gradients would pile up); its wait() returns at once
        # and raises a failure here
        waiting = []
        for work in self._pending:
            if work.is_completed():
                work.wait()
            else:
                waiting.append(work)
        self._pending = waiting + [sent]
        return received

    def rollback(self) -> None:
        """After a failed step, also drop the messages it queued, took early or left in flight."""
        super().rollback()
        self._outbox, self._pending, self._inbox = [], [], {}
        self._early.clear()
        self._local.clear()

    def _wait_sends(self) -> None:
        self._post([])
        for work in self._pending:
            work.wait()
        self._pending = []

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        """Float activations and gradients travel in the compute dtype (bf16 under dtype=bf16)."""
        return self.compute_dtype if self.compute_dtype is not None and dtype.is_floating_point else dtype

    # ----------------------------------------------------------------------------- one microbatch
    def _forward(self, stage: int, mb: int, piece: tuple) -> InFlight:
        spec = self.specs[stage]
        values = self._input_values(piece)
        received = {}
        for producer in range(stage):
            for index in messages_from(self.specs, producer, stage):
                value = self._get((producer, stage, index), FORWARD, mb)
                received[(producer, index)] = value.requires_grad_(carries_gradient(self.specs,
                                                                                     (producer, stage, index)))
        args = [values[s[1]] if s[0] == "input" else received[(s[1], s[2])] for s in spec.sources]
        self._key_random(self.modules[stage], mb)
        with self._saved_tensor_hooks():
            out = self.modules[stage](*args)
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        for consumer in consumers_of(self.specs, stage):
            for index in messages_from(self.specs, stage, consumer):
                out = outputs[index]
                self._put((stage, consumer, index), FORWARD, mb, out.detach().to(self._wire(out.dtype)))
        if stage != self._last_stage:
            return InFlight(received, outputs)
        # the token count stays on the device: the step's one host sync is the global loss
        loss, count, empty = loss_parts(outputs)
        return InFlight(received, outputs, count, microbatch_share(loss, count, empty, self.program.count_transform))

    def _roots(self, stage: int, mb: int, flight: InFlight) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """What backward starts from: the last stage's token-weighted loss sum, or the stage outputs
        with the gradients their consumers sent back (summed over consumers)."""
        if stage == self._last_stage:
            return [(flight.share, None)]
        grads: list[torch.Tensor | None] = [None] * len(flight.outputs)
        for consumer in consumers_of(self.specs, stage):
            for index in messages_from(self.specs, stage, consumer):
                if carries_gradient(self.specs, (stage, consumer, index)):
                    g = self._get((stage, consumer, index), BACKWARD, mb).to(flight.outputs[index].dtype)
                    grads[index] = g if grads[index] is None else grads[index] + g
        return [(o, g) for o, g in zip(flight.outputs, grads) if g is not None and o.requires_grad]

    def _send_input_grads(self, stage: int, mb: int, flight: InFlight, grads: dict) -> None:
        for (producer, index), value in sorted(flight.received.items()):
            kind = (producer, stage, index)
            if carries_gradient(self.specs, kind):
                grad = grads.get((producer, index))
                grad = grad if grad is not None else torch.zeros_like(value)
                self._put(kind, BACKWARD, mb, grad.to(self._wire(value.dtype)))

    def _backward(self, stage: int, mb: int, flight: InFlight) -> None:
        """B: input and weight gradients in one pass."""
        roots = self._roots(stage, mb, flight)
        if roots:
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
        self._send_input_grads(stage, mb, flight, {key: v.grad for key, v in flight.received.items()})

    def _input_grad(self, stage: int, mb: int, flight: InFlight) -> None:
        """I: only the gradients of what the stage received (what the previous stage waits for);
        the graph is kept for W (runtime/pipeline_backward.py)."""
        roots = self._roots(stage, mb, flight)
        keys = [key for key, v in sorted(flight.received.items()) if v.requires_grad]
        grads = {}
        if roots:
            found, flight.weight_work = input_grads([t for t, _ in roots], [g for _, g in roots],
                                                    [flight.received[k] for k in keys], self.stage_params[stage])
            grads = dict(zip(keys, found))
        self._send_input_grads(stage, mb, flight, grads)

    def _weight_grad(self, stage: int, mb: int, flight: InFlight) -> None:
        """W: the weight gradients, accumulated into .grad as B would have."""
        if flight.weight_work is not None:
            weight_grads(flight.weight_work)
            flight.weight_work = None

    # ------------------------------------------------------------------------------------ a step
    def _run_schedule(self, batch: tuple, *, train: bool) -> tuple[torch.Tensor, float]:
        micro = self.check_batch(batch)
        self._set_step_divisors(micro)
        self._inbox = {peer: list(order) for peer, order in self._orders[train].items()}
        flights: dict[tuple[int, int], InFlight] = {}
        total, count = torch.zeros((), dtype=torch.float64, device=self.device), 0.0
        for index, action in enumerate(self.actions):
            op, key = action.op.value, (action.stage, action.mb)
            if op == "F":
                with self._span(f"F{action.mb}"), torch.set_grad_enabled(train):
                    flights[key] = self._forward(action.stage, action.mb, micro[action.mb])
                if action.stage == self._last_stage:
                    flight = flights[key]
                    total = total + flight.share.detach().double()
                    count += flight.count
            elif train:
                final = self._final_backward.get(action.stage) == index
                if final:  # before the stage's last backward: what its earlier microbatches accumulated
                    self._accumulated = self._most(self._accumulated, self.memory_bytes())
                with contextlib.nullcontext() if final else self.reducer.no_sync(), self._span(f"{op}{action.mb}"):
                    self._BACKWARD_STEPS[op](self, action.stage, action.mb, flights[key])
                if not final and op in ("B", "W") and self.reducer.scatters_each:
                    self.reducer.settle()
                if op in ("B", "W"):
                    del flights[key]
        return total, count

    # Which method runs each backward action of a schedule.
    _BACKWARD_STEPS = {"B": _backward, "I": _input_grad, "W": _weight_grad}

    def _pipeline_global(self, total: torch.Tensor, count) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's (token-weighted loss sum, count), on every pp rank, on the device (the
        step's one host sync is the global loss)."""
        count = count if isinstance(count, torch.Tensor) else torch.full((), count, dtype=torch.float64,
                                                                          device=self.device)
        both = torch.stack([total.double(), count])
        if not self._last:
            both = torch.zeros_like(both)
        both = self.pp.all_reduce(both)
        return both[0], both[1]

    def step(self, batch: tuple) -> float:
        self._accumulated = None
        with self._state_cast_once():
            total, count = self._run_schedule(batch, train=True)
        self._wait_sends()
        total, count = self._pipeline_global(total, count)
        count = step_count(count, self.program.count_transform)
        # sums commute with the scaling by 1/count, known only now: the buckets launched during
        # the last backward carry unscaled sums, so every gradient is scaled once reduced
        self._sum_shared_grads()  # before the dp reduction: ZeRO-2 keeps only slices after it
        self.overlapped_buckets = self.reducer.finish()  # launched while backward still ran
        # count is a device tensor (read on the host it would be a second sync): with no counted
        # token 1 / count is inf, the loss below is NaN and the step is refused and rolled back
        self._scale_reduced(1.0 / count)
        self.peak_state_bytes = self._most(self._accumulated, self.memory_bytes())
        value = self._global(total / count)
        self._check_finite(value, count)
        self._clip_if_asked()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.reducer.attach_grad_views()
        self._write_buffers()
        return value

    def evaluate(self, batch: tuple) -> float:
        with self._state_cast_once():
            total, count = self._run_schedule(batch, train=False)
        self.pending_writes.clear()  # evaluation updates nothing
        self._wait_sends()
        total, count = self._pipeline_global(total, count)
        count = step_count(count, self.program.count_transform)
        return self._global(total / count)

    def _sum_shared_grads(self) -> None:
        """A weight used by stages on two ranks (tied embedding / lm head) gets both stages' gradients
        (every pp rank joins the sum; one that does not hold the weight adds zeros)."""
        for name in self.shared:
            param = self.state.get(name)
            if param is None:
                self.pp.all_reduce(self._held_or_zeros(self.state_specs[name]))
                continue
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            param.grad = self.pp.all_reduce(grad)

    def _counts(self, spec, sharded: tuple[str, ...]) -> bool:
        """A pipeline rank counts the weights it owns (a tied weight: the first stage using it)."""
        owner = self.owner.get(spec.placeholder, self.pp_rank)
        return owner == self.pp_rank and counted_once(spec.layout.placements, self.mesh.axes, self.mesh.coord,
                                                      sharded=sharded, skip=("pp",))

    def _owned(self, spec, value: torch.Tensor) -> torch.Tensor:
        """The owning stage's value of a state tensor, on every pp rank (a collective)."""
        mine = value if self.owner.get(spec.placeholder, 0) == self.pp_rank else torch.zeros_like(value)
        return self.pp.all_reduce(mine)
