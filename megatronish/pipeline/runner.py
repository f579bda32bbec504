"""Pipeline schedules: one optimizer step's micro-batches through the pipeline stages.

Each stage runs GPT.stage_forward on its layers, with the micro-batch's documents under
document masks (every stage has the whole batch, so they need not travel); the last stage
hands its output to the objective (megatronish.objectives). Between stages
travel the hidden states
[micro, s, h] (a tp rank's sequence shard [micro, s/t, h] under sequence parallelism: every tp
rank sends its own shard to the same tp rank of the next stage) and, backwards, their
gradients. Sends and receives that a stage issues at the same time are posted together
(comm.exchange), so neighbours never wait on each other's order.

Schedules over m micro-batches on p stages (stage r):
- gpipe: the m forwards, then the m backwards; a stage holds the activations of all m.
- 1f1b: p - r - 1 warm-up forwards, then one forward and one backward in turn, then the
  remaining backwards; a stage holds at most p - r micro-batches of activations.
Both run backwards in micro-batch order, as the single-stage loop does, so the gradients are
accumulated in the same order at every pp. The idle time of either is the bubble: (p - 1) / m
of the ideal step time, when the stages take equal time.

Interleaved (parallel.pp_virtual = v > 1): see megatronish.pipeline.schedule, which places every
rank's operations on a common clock; this module runs them.
"""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass

import torch

from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.objectives.batch import MicroBatch
from megatronish.objectives.interface import Objective
from megatronish.observe.phases import PhaseTimer
from megatronish.pipeline.schedule import Op, Tick, interleaved_ticks


@dataclass
class ScheduleStats:
    """What one run of a schedule did on this stage: the most micro-batches whose activations
    were held at once, seconds spent computing, waiting for neighbours and in all, and (when
    measured) the peak bytes of the tensors autograd held for backward."""

    max_in_flight: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    peak_saved_bytes: int = 0


class SavedTensorMeter:
    """Counts the bytes of the tensors autograd saves for backward while they are alive
    (parameters excluded): each saved tensor is wrapped, and the wrapper, freed with the
    graph after backward, takes its bytes off the count."""

    def __init__(self, params):
        self.skip = {p.data_ptr() for p in params}
        self.live = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if tensor.data_ptr() in self.skip:
            return tensor
        return _Saved(tensor, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved


class _Saved:
    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter):
        self.tensor, self.meter = tensor, meter
        self.nbytes = tensor.numel() * tensor.element_size()
        meter.live += self.nbytes
        meter.peak = max(meter.peak, meter.live)

    def __del__(self):
        self.meter.live -= self.nbytes


class Pipeline:
    """Runs micro-batches through this rank's stage of `model` with schedule `schedule`
    (gpipe | 1f1b), interleaved over the model's chunks when it has more than one
    (parallel.pp_virtual). The loss is computed on the last stage; run() returns the sum of the
    micro-batch losses there (and zero on other stages)."""

    def __init__(
        self,
        model,
        ps: ParallelState,
        schedule: str,
        measure_memory: bool = False,
        timer: PhaseTimer | None = None,
    ):
        self.model, self.ps, self.schedule = model, ps, schedule
        # The run's phase timer: forward, backward, and the waits for neighbours as "bubble".
        self.timer = timer if timer is not None else PhaseTimer(False, ps.device)
        self.prev = ps.global_rank(ps.tp_rank, ps.dp_rank, ps.pp_rank - 1)
        self.next = ps.global_rank(ps.tp_rank, ps.dp_rank, ps.pp_rank + 1)
        self.virtual = len(model.chunks)
        self.meter = SavedTensorMeter(model.parameters()) if measure_memory else None
        self.stats = ScheduleStats()

    # ---- communication with the neighbouring stages

    def _buffer(self, tokens: torch.Tensor) -> torch.Tensor:
        """A buffer for the hidden states of the micro-batch of `tokens` [b, s / cp]: the
        micro-batches of a step may differ in length (packed sequences)."""
        shape = self.model.activation_shape(tokens.shape[0], tokens.shape[1] * self.ps.cp)
        return torch.empty(shape, dtype=torch.float32, device=self.ps.device)

    def _exchange(self, sends, recvs) -> None:
        start = time.perf_counter()
        with self.timer.phase("bubble"):
            comm.exchange(sends, recvs)
        self.stats.wait_s += time.perf_counter() - start

    def _recv_forward(self, micro: MicroBatch) -> torch.Tensor:
        """This stage's input for `micro`: its tokens on the first stage, else the previous
        stage's hidden states (a leaf that collects their gradient)."""
        if self.ps.is_first_stage:
            return micro.tokens
        buffer = self._buffer(micro.tokens)
        self._exchange([], [(buffer, self.prev)])
        return buffer.requires_grad_(True)

    def _send_forward(self, output: torch.Tensor) -> None:
        if not self.ps.is_last_stage:
            assert output.dtype == torch.float32, "hidden states between stages are fp32"
            self._exchange([(output.detach(), self.next)], [])

    def _send_forward_recv_backward(
        self, output: torch.Tensor, oldest: torch.Tensor
    ) -> torch.Tensor | None:
        """Sends output on and receives the gradient of `oldest`, the output whose backward
        comes next (its micro-batch may be of another length)."""
        if self.ps.is_last_stage:
            return None
        grad = torch.empty_like(oldest)
        self._exchange([(output.detach(), self.next)], [(grad, self.next)])
        return grad

    def _recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        if self.ps.is_last_stage:
            return None
        grad = torch.empty_like(output)
        self._exchange([], [(grad, self.next)])
        return grad

    def _send_backward(self, grad: torch.Tensor | None) -> None:
        if not self.ps.is_first_stage:
            self._exchange([(grad, self.prev)], [])

    def _send_backward_recv_forward(self, grad, micro: MicroBatch) -> torch.Tensor:
        if self.ps.is_first_stage:
            return micro.tokens
        buffer = self._buffer(micro.tokens)
        self._exchange([(grad, self.prev)], [(buffer, self.prev)])
        return buffer.requires_grad_(True)

    def _wait(self, handle) -> None:
        start = time.perf_counter()
        with self.timer.phase("bubble"):
            handle.wait()
        self.stats.wait_s += time.perf_counter() - start

    def _peer(self, pp_rank: int) -> int:
        """The global rank of pipeline rank pp_rank with this rank's other coordinates."""
        return self.ps.global_rank(self.ps.tp_rank, self.ps.dp_rank, pp_rank)

    # ---- compute

    def _first(self, chunk: int | None) -> bool:
        """Whether the model chunk (None: the whole stage) starts the model."""
        return self.ps.is_first_stage and chunk in (None, 0)

    def _last(self, chunk: int | None) -> bool:
        """Whether the model chunk (None: the whole stage) ends the model (holds the loss)."""
        return self.ps.is_last_stage and chunk in (None, self.virtual - 1)

    def _forward(
        self,
        inputs: torch.Tensor,
        micro: MicroBatch,
        scale: float,
        autocast,
        chunk: int | None = None,
    ):
        """(output, what backward starts from) of this stage, or of its model chunk `chunk`
        (0 .. v - 1) under interleaving: hidden states, or the total of the micro-batch's
        losses (self.objective) scaled by `scale` at the end of the model (its unscaled main
        loss added to the loss sum, its multi-token prediction loss to mtp_sum)."""
        start = time.perf_counter()
        saving = self.meter.hooks() if self.meter is not None else contextlib.nullcontext()
        last = self._last(chunk)
        with self.timer.phase("forward"), saving, autocast():
            if chunk is None:
                output = self.model.stage_forward(inputs, micro.documents)
            else:
                output = self.model.chunk_forward(chunk, inputs, micro.documents)
            if last:
                losses = self.objective.losses(self.model, output, micro)
        if last:
            self.loss_sum += losses.main.detach()
            if losses.mtp is not None:
                self.mtp_sum += losses.mtp.detach()
            output = losses.total * scale
        self.stats.compute_s += time.perf_counter() - start
        return output

    def _backward(
        self, inputs: torch.Tensor, output: torch.Tensor, grad, chunk: int | None = None
    ) -> torch.Tensor | None:
        """Backward of one micro-batch through this stage (or its model chunk `chunk`); the
        gradient of its input (None at the start of the model)."""
        start = time.perf_counter()
        with self.timer.phase("backward"):
            torch.autograd.backward(output, grad_tensors=grad)
        self.stats.compute_s += time.perf_counter() - start
        return None if self._first(chunk) else inputs.grad

    # ---- schedules

    def run(
        self,
        batch: list[MicroBatch],
        objective: Objective,
        scale: float,
        autocast,
        *,
        forward_only: bool = False,
    ):
        """Forward (and, unless forward_only, backward) of every micro-batch of a step (this
        rank's sequence shard under cp); each micro-batch's total loss (objective's, on the
        last stage) is scaled by `scale` for backward. Returns the sum of the micro-batch main
        losses (zero except on the last stage); that of their multi-token prediction losses is
        mtp_sum."""
        start = time.perf_counter()
        self.objective = objective
        self.loss_sum = torch.zeros((), device=self.ps.device)
        self.mtp_sum = torch.zeros((), device=self.ps.device)
        self.stats = ScheduleStats()
        if self.virtual > 1:
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                self._interleaved(batch, scale, autocast, forward_only)
        elif forward_only:
            with torch.no_grad():
                for micro in batch:
                    output = self._forward(self._recv_forward(micro), micro, scale, autocast)
                    self._send_forward(output)
        elif self.schedule == "gpipe":
            self._gpipe(batch, scale, autocast)
        else:
            self._one_f_one_b(batch, scale, autocast)
        if self.meter is not None:
            self.stats.peak_saved_bytes, self.meter.peak = self.meter.peak, self.meter.live
        self.stats.total_s = time.perf_counter() - start
        return self.loss_sum

    def _hold(self, held: list, item) -> None:
        held.append(item)
        self.stats.max_in_flight = max(self.stats.max_in_flight, len(held))

    def _gpipe(self, batch, scale, autocast) -> None:
        held: list = []
        for micro in batch:
            inputs = self._recv_forward(micro)
            output = self._forward(inputs, micro, scale, autocast)
            self._send_forward(output)
            self._hold(held, (inputs, output))
        for inputs, output in held:
            grad = self._recv_backward(output)
            self._send_backward(self._backward(inputs, output, grad))

    def _one_f_one_b(self, batch, scale, autocast) -> None:
        m, ps = len(batch), self.ps
        warmup = min(ps.pp - ps.pp_rank - 1, m)
        held: list = []
        for index in range(warmup):
            inputs = self._recv_forward(batch[index])
            output = self._forward(inputs, batch[index], scale, autocast)
            self._send_forward(output)
            self._hold(held, (inputs, output))
        inputs = self._recv_forward(batch[warmup]) if warmup < m else None
        for index in range(warmup, m):
            output = self._forward(inputs, batch[index], scale, autocast)
            self._hold(held, (inputs, output))
            oldest_inputs, oldest_output = held.pop(0)
            grad = self._send_forward_recv_backward(output, oldest_output)
            grad_in = self._backward(oldest_inputs, oldest_output, grad)
            if index + 1 < m:
                inputs = self._send_backward_recv_forward(grad_in, batch[index + 1])
            else:
                self._send_backward(grad_in)
        for oldest_inputs, oldest_output in held:
            grad = self._recv_backward(oldest_output)
            self._send_backward(self._backward(oldest_inputs, oldest_output, grad))

    def _interleaved(self, batch: list[MicroBatch], scale, autocast, forward_only: bool) -> None:
        """This rank's ticks of interleaved_ticks: each one's operation, then one batch of its
        sends and receives, posted without waiting. A receive is waited for when its operation
        runs; every batch at the latest 2 pp ticks later (its peers are past that tick by then;
        waiting releases the tensors it holds), the last ones after the last tick."""
        ps = self.ps
        ticks = interleaved_ticks(ps.pp, self.virtual, len(batch), self.schedule, forward_only)
        inbox: dict[Op, tuple[torch.Tensor, object]] = {}  # received (buffer, batch handle)
        # (micro-batch, chunk) -> (inputs, output) until its backward; None: forward only
        held: dict[tuple[int, int], tuple] | None = None if forward_only else {}
        posted: collections.deque = collections.deque()  # (tick, handle), oldest first
        for tick in ticks[ps.pp_rank]:
            sent = None
            if tick.op is not None:
                sent = self._run_op(tick.op, batch, inbox, held, scale, autocast)
            handle = self._post_tick(tick, sent, inbox, batch)
            if handle is not None:
                posted.append((tick.at, handle))
            while posted and posted[0][0] < tick.at - 2 * ps.pp:
                self._wait(posted.popleft()[1])
        for _, handle in posted:
            self._wait(handle)

    def _post_tick(self, tick: Tick, sent, inbox: dict, batch: list[MicroBatch]):
        """Posts the tick's send (of `sent`) and receives as one batch without waiting; each
        receive's buffer goes into inbox under its key, with the batch's handle. Returns the
        handle (None: nothing to post)."""
        sends = [] if tick.send is None else [(sent, self._peer(tick.send))]
        recvs = [(key, self._buffer(batch[key[1]].tokens), peer) for key, peer in tick.recvs]
        if not (sends or recvs):
            return None
        start = time.perf_counter()
        with self.timer.phase("bubble"):
            handle = comm.start_exchange(
                sends, [(buffer, self._peer(peer)) for _, buffer, peer in recvs]
            )
        self.stats.wait_s += time.perf_counter() - start
        inbox.update((key, (buffer, handle)) for key, buffer, _ in recvs)
        return handle

    def _received(self, inbox: dict, key: Op) -> torch.Tensor:
        buffer, handle = inbox.pop(key)
        self._wait(handle)
        return buffer

    def _run_op(self, op: Op, batch, inbox, held, scale, autocast) -> torch.Tensor | None:
        """Runs one (micro-batch, global chunk) forward or backward of the interleaved
        schedule; what it sends on: the chunk's output, or the gradient of its input."""
        kind, index, chunk = op
        local, micro = chunk // self.ps.pp, batch[index]
        if kind == "F":
            if self._first(local):
                inputs = micro.tokens
            else:
                inputs = self._received(inbox, op).requires_grad_(True)
            output = self._forward(inputs, micro, scale, autocast, local)
            if held is not None:
                held[(index, chunk)] = (inputs, output)
                self.stats.max_in_flight = max(self.stats.max_in_flight, len(held))
            if self._last(local):
                return None
            assert output.dtype == torch.float32, "hidden states between stages are fp32"
            return output.detach()
        inputs, output = held.pop((index, chunk))
        grad = None if self._last(local) else self._received(inbox, op)
        return self._backward(inputs, output, grad, local)
