"""What each rank runs: rank 0's DriverRunner schedules nothing itself but broadcasts every step the
engine gives it before running its shard; every other rank builds its shard and replays those steps
(serve_rank) until rank 0 closes."""
import traceback

import torch

from ..config import EngineConfig
from ..checkpoints.loader import open_checkpoint
from ..execution.model_runner import ModelRunner, host_tier_size, load_rank_model, pool_size
from ..serving.scheduler import ScheduledBatch
from .step_message import StepMessage
from .workers import report_failure


class DriverRunner(ModelRunner):
    """Rank 0's model runner: broadcasts each step, runs its shard, samples from the gathered logits.
    A failure once the step is sent leaves the ranks out of step, so it shuts the group down; one before
    (building the step's inputs) leaves them in step, and the engine rolls the step back as usual."""

    def __init__(self, model, config: EngineConfig, num_blocks: int, num_cpu_blocks: int, seed: int,
                 num_host_blocks: int, tp):
        super().__init__(model, config, num_blocks, num_cpu_blocks, seed, num_host_blocks)
        self.tp = tp

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, bm) -> list[list[int]]:
        self.tp.check_open()
        step = self._prepare(batch, bm) if batch.seqs else None
        message = StepMessage.of(batch, step)
        try:
            self.tp.send(message.pack())
            loads = self._move_blocks(message, defer_loads=step is not None)
            if step is None:
                return []
            input_ids, positions, meta = step
            logits = self.model.compute_logits(self._forward(input_ids, positions, meta, loads))
        except BaseException:
            self.tp.close(stop_workers=False)
            raise
        return self._sample(logits, batch)

    @torch.inference_mode()
    def move_blocks(self, moves: ScheduledBatch) -> None:
        self.tp.check_open()
        message = StepMessage.of(moves)
        try:
            self.tp.send(message.pack())
            self._move_blocks(message)
        except BaseException:
            self.tp.close(stop_workers=False)
            raise


@torch.inference_mode()
def serve(runner: ModelRunner, tp) -> None:
    """Replays rank 0's steps until it closes."""
    while (packed := tp.receive()) is not None:
        message = StepMessage.unpack(packed, runner.device)
        step = message.step()
        loads = runner._move_blocks(message, defer_loads=step is not None)
        if step is not None:
            input_ids, positions, meta = step
            runner.model.compute_logits(runner._forward(input_ids, positions, meta, loads))


def serve_rank(tp, config: EngineConfig, model_path: str, seed: int, pack_cpu_weights: bool):
    """A rank other than 0: builds its shard and its runner, serves rank 0 until it closes, then exits the
    process (SystemExit(0)). A failure is left in the store for rank 0 and re-raised."""
    try:
        model = load_rank_model(open_checkpoint(model_path), config, pack_cpu_weights=pack_cpu_weights, tp=tp)
        num_blocks = pool_size(model, config, tp)
        runner = ModelRunner(model, config, num_blocks, config.num_cpu_blocks, seed, host_tier_size(model, config, tp))
        serve(runner, tp)
    except BaseException:
        report_failure(tp.store, tp.rank, traceback.format_exc())
        raise
    raise SystemExit(0)
