"""Pipeline schedules: one optimizer step's micro-batches through the pipeline stages.

Each stage runs GPT.stage_forward on its layers. Between stages travel the hidden states
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
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from megatronish import comm
from megatronish.observe.phases import PhaseTimer
from megatronish.parallel import ParallelState


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
    (gpipe | 1f1b). The loss is computed on the last stage; run() returns the sum of the
    micro-batch losses there (and zero on other stages)."""

    def __init__(
        self,
        model,
        ps: ParallelState,
        schedule: str,
        seq_len: int,
        measure_memory: bool = False,
        timer: PhaseTimer | None = None,
    ):
        self.model, self.ps, self.schedule, self.seq_len = model, ps, schedule, seq_len
        # The run's phase timer: forward, backward, and the waits for neighbours as "bubble".
        self.timer = timer if timer is not None else PhaseTimer(False, ps.device)
        self.prev = ps.global_rank(ps.tp_rank, ps.dp_rank, ps.pp_rank - 1)
        self.next = ps.global_rank(ps.tp_rank, ps.dp_rank, ps.pp_rank + 1)
        self.meter = SavedTensorMeter(model.parameters()) if measure_memory else None
        self.stats = ScheduleStats()

    # ---- communication with the neighbouring stages

    def _buffer(self, micro_batch_size: int) -> torch.Tensor:
        shape = self.model.activation_shape(micro_batch_size, self.seq_len)
        return torch.empty(shape, dtype=torch.float32, device=self.ps.device)

    def _exchange(self, sends, recvs) -> None:
        start = time.perf_counter()
        with self.timer.phase("bubble"):
            comm.exchange(sends, recvs)
        self.stats.wait_s += time.perf_counter() - start

    def _recv_forward(self, micro: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """This stage's input for micro-batch `micro` (inputs, targets) [b, s] each: its tokens
        on the first stage, else the previous stage's hidden states (a leaf that collects
        their gradient)."""
        if self.ps.is_first_stage:
            return micro[0]
        buffer = self._buffer(micro[0].shape[0])
        self._exchange([], [(buffer, self.prev)])
        return buffer.requires_grad_(True)

    def _send_forward(self, output: torch.Tensor) -> None:
        if not self.ps.is_last_stage:
            assert output.dtype == torch.float32, "hidden states between stages are fp32"
            self._exchange([(output.detach(), self.next)], [])

    def _send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        if self.ps.is_last_stage:
            return None
        grad = torch.empty_like(output)
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

    def _send_backward_recv_forward(self, grad, micro: tuple) -> torch.Tensor:
        if self.ps.is_first_stage:
            return micro[0]
        buffer = self._buffer(micro[0].shape[0])
        self._exchange([(grad, self.prev)], [(buffer, self.prev)])
        return buffer.requires_grad_(True)

    # ---- compute

    def _forward(self, inputs: torch.Tensor, micro: tuple, scale: float, autocast):
        """(output, what backward starts from): hidden states on inner stages, the micro-batch
        loss scaled by `scale` on the last stage (its unscaled value added to the loss sum)."""
        start = time.perf_counter()
        saving = self.meter.hooks() if self.meter is not None else contextlib.nullcontext()
        with self.timer.phase("forward"), saving, autocast():
            output = self.model.stage_forward(inputs)
            if self.ps.is_last_stage:
                loss = self.model.loss_of_logits(output, micro[1])
        if self.ps.is_last_stage:
            self.loss_sum += loss.detach()
            output = loss * scale
        self.stats.compute_s += time.perf_counter() - start
        return output

    def _backward(self, inputs: torch.Tensor, output: torch.Tensor, grad) -> torch.Tensor | None:
        """Backward of one micro-batch through this stage; the gradient of its input (None on
        the first stage)."""
        start = time.perf_counter()
        with self.timer.phase("backward"):
            torch.autograd.backward(output, grad_tensors=grad)
        self.stats.compute_s += time.perf_counter() - start
        return None if self.ps.is_first_stage else inputs.grad

    # ---- schedules

    def run(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        scale: float,
        autocast,
        forward_only: bool = False,
    ):
        """Forward (and, unless forward_only, backward) of every micro-batch of inputs and
        targets [m, micro, s] (this rank's sequence shard under cp); each micro-batch's loss is
        scaled by `scale` for backward. Returns the sum of the micro-batch losses (zero except
        on the last stage)."""
        start = time.perf_counter()
        batch = list(zip(inputs, targets))  # (inputs, targets) of each micro-batch
        self.loss_sum = torch.zeros((), device=self.ps.device)
        self.stats = ScheduleStats()
        if forward_only:
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
            grad = self._send_forward_recv_backward(output)
            oldest_inputs, oldest_output = held.pop(0)
            grad_in = self._backward(oldest_inputs, oldest_output, grad)
            if index + 1 < m:
                inputs = self._send_backward_recv_forward(grad_in, batch[index + 1])
            else:
                self._send_backward(grad_in)
        for oldest_inputs, oldest_output in held:
            grad = self._recv_backward(oldest_output)
            self._send_backward(self._backward(oldest_inputs, oldest_output, grad))
