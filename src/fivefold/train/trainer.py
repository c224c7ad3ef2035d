"""The training loop: the same for every layout, single-process or any mix of the five folds.

Everything layout-specific is decided once, before the first step, by `parallelize` (parallel/):
this rank's model part, its gradient sync and its step function. Each optimizer step then:

    batches      this rank's micro-batches of the global batch (the sampler is a pure function of the step;
                 the data-parallel rank picks samples, the context-parallel rank its part of each sequence)
    tokens       target tokens of the step over the sync's loss group (token weighting:
                 loss = sum over ranks and micro-batches of sum_t CE_t / total target tokens)
    step         forward and backward of every micro-batch, then `update`: the non-finite guard's verdict,
                 clip the global gradient norm, the scheduled learning rate, optimizer step (or, for a bad
                 step, none), after-step
    metrics      loss, lr, grad norm, and what reporting reads from the sync and step function
    evaluation and checkpoints at their intervals
Fault handling is one component called at fixed points (reliability/supervisor.py): step start, the update,
the step's verdict (continue, roll back, stop). Where the run starts, saving and rollback are
train/checkpointing.py's. `close` releases the trainer. With one process this is the reference every layout
is tested against.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fivefold.config import JobConfig
from fivefold.data.dataset import PreparedData, eval_batches, sample_batch, unigram_cross_entropy
from fivefold.model import build_model
from fivefold.optim import lr_at
from fivefold.parallel.mesh import Mesh, OwnedGroups, collective_timeout, mesh_for
from fivefold.parallel.parallelize import parallelize
from fivefold.parallel.step import target_tokens
from fivefold.parallel.validate import check_config
from fivefold.parallel.tensor_parallel import IGNORE_INDEX  # noqa: F401 - re-exported for tests and users
from fivefold.plan.flops import count_parameters, flops_per_token
from fivefold.progress import announce
from fivefold.reliability.guard import Action, Check, states_finite
from fivefold.reliability.supervisor import Supervisor, shared_attempt_id
from fivefold.train.checkpoint import TrainerState
from fivefold.train.checkpointing import RunCheckpoints
from fivefold.train.distributed import all_reduce_sum, init_distributed, local_device
from fivefold.train.feasibility import check_eval_windows, check_fits
from fivefold.train.final_sample import final_sample
from fivefold.train.metrics import MetricsLogger, peak_tflops, plot_losses
from fivefold.train.reporting import Reporter, TrainResult, completed_result
from fivefold.train.routing_report import RoutingReport, describe_experts, plot_expert_load
from fivefold.train.setup import cap_threads, prepare_data_once, rank0_printer, resolve_device, resolve_model_config


class Trainer:
    def __init__(self, config: JobConfig, data: PreparedData | None = None, mesh: Mesh | None = None,
                 supervisor: Supervisor | None = None):
        config = check_config(config)
        t = config.train
        cap_threads(t.threads)
        self._groups, self._closed = OwnedGroups.start(), False  # what close() destroys: the groups made here
        self.env = init_distributed(resolve_device(t.device), collective_timeout(config))
        self.is_rank0 = self.env.is_rank0
        self.device = local_device(resolve_device(t.device), self.env)
        self.mesh = mesh or mesh_for(config, self.env.world_size, self.device.type)
        self.dims, distributed = self.mesh.dims, self.mesh.dims.world_size > 1
        self.output_dir = Path(t.output_dir)
        self.supervisor = supervisor or Supervisor(config, self.output_dir, self.env.rank, self.env.world_size,
                                                   shared_attempt_id(distributed, self.mesh.trainer_group()))
        # what the trainer's parts keep (its printer, the autocast factory) holds no bound method of it: a cycle back
        # to the trainer would keep its model, optimizer and device memory after `del` until a garbage collection
        self._print = rank0_printer(self.is_rank0)
        self.checkpoints = RunCheckpoints(config, self.mesh, self.env.rank, distributed, self.supervisor, self._print)
        self.supervisor.start(resumed_from=str(self.checkpoints.resumed_from or ""))
        self.data = data or prepare_data_once(config, self.env.world_size, self.is_rank0, self.supervisor.attempt_id,
                                              self._print if self.is_rank0 else None)
        self.model_config = resolve_model_config(config.model, self.data.tokenizer.vocab_size)
        check_fits(config, self.model_config, self.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        check_eval_windows(config, len(self.data.val_tokens))
        configured_accum = config.train.grad_accum_steps
        self.config = config = check_config(self.checkpoints.adjusted_config(config, self.model_config, self.dims.dp,
                                                                             self.data.fingerprint))
        t = config.train
        torch.manual_seed(t.seed)
        self.autocast_dtype = torch.bfloat16 if t.dtype == "bf16" else None
        autocast = functools.partial(torch.autocast, self.device.type, dtype=self.autocast_dtype,
                                     enabled=self.autocast_dtype is not None)
        self.parallel = parallelize(build_model(self.model_config), self.mesh, config, self.device, autocast,
                                    pretrained=self.checkpoints.resumed_from is None)
        self.model, self.sync, self.step_fn = self.parallel.model, self.parallel.sync, self.parallel.step
        self.routing = RoutingReport(self.model, self.mesh.group("pp"), self.parallel.alltoall,
                                     config.logging.moe_load_by_rank)
        self.tokens_per_step = t.micro_batch_size * t.grad_accum_steps * self.dims.dp * t.seq_len
        state = self.checkpoints.restore(self.parallel) or TrainerState(0, 0, t.seed)
        self.routing.load_biases(state.expert_bias)
        self.state = dataclasses.replace(state, seed=t.seed, global_batch=t.micro_batch_size * t.grad_accum_steps * self.dims.dp,
                                         data_parallel=self.dims.dp, data_fingerprint=self.data.fingerprint,
                                         grad_accum_configured=state.grad_accum_configured or configured_accum)
        self.resumed_from = self.checkpoints.resumed_from
        synchronous = self.sync.loss_group is not None or self.dims.world_size == 1
        self.supervisor.attach_guard(self.mesh.trainer_group() if synchronous else None, distributed and synchronous,
                                     self.parallel.folds.tp)
        self.flops_per_token = flops_per_token(self.model_config, t.seq_len)
        peak, self.peak_source = peak_tflops(self.device, t.peak_tflops)
        self.report = Reporter(config, self.parallel, self.env.world_size, self.flops_per_token, peak, self.device,
                               self.output_dir)
        self._groups.stop()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, error_type, *_) -> None:
        self.close(settle=error_type is None)  # after an error the peers may be gone: no deferred update's collective

    def close(self, settle: bool = True) -> Path | None:
        """Release what the trainer holds, on every rank (`fit` does; else call it, or use `with`): deferred update,
        checkpoint writer, sync, heartbeat, its process groups (mesh.py OwnedGroups); returns the last checkpoint."""
        if self._closed:
            return None
        self._closed = True
        if settle:
            self.sync.flush()
        last = self.checkpoints.wait()
        self.checkpoints.close()
        self.sync.close()
        self.supervisor.finish()
        self._groups.destroy()
        return last

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.sync.optimizer

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """This rank's (inputs, labels, positions) micro-batches of optimizer step `step` (after skipped data)."""
        t, at = self.config.train, step + self.state.data_offset
        return [self._local(*sample_batch(self.data.train_tokens, t.seq_len, t.micro_batch_size, t.seed, at, i,
                                          t.grad_accum_steps, self.parallel.dp_rank, self.dims.dp))
                for i in range(t.grad_accum_steps)]

    def _local(self, inputs: torch.Tensor, labels: torch.Tensor):
        return self.parallel.folds.shard_sequence(inputs.to(self.device), labels.to(self.device))

    def train_step(self) -> dict[str, float]:
        """One optimizer step at `self.state.step`; returns its metrics (`skipped` set when the guard withheld it)."""
        if self._closed:
            raise RuntimeError("this Trainer is closed (by close() or the end of fit()): build a new one to train on")
        t, sup = self.config.train, self.supervisor
        step = self.state.step
        sup.begin_step(step + 1)
        self.step_fn.loss_factor = sup.loss_factor(step + 1 + self.state.data_offset)  # a bad batch: keyed by data
        batches = self.micro_batches(step)
        local = torch.tensor(float(target_tokens(batches)), device=self.device)
        total_tokens = int(all_reduce_sum(local, self.sync.loss_group))
        logged = (step + 1) % t.log_every == 0 or step + 1 == t.steps
        metrics = {"lr": lr_at(step, self.config.optim, t.steps) * self.state.lr_scale}
        self.check = Check(False, "", float("nan"))

        def update(local_loss_sum: torch.Tensor) -> None:  # gradients final: judge, clip, step, after-step
            norm = self.sync.clip_grad_norm_(t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
            metrics["grad_norm"] = norm
            self.check = sup.check_update(local_loss_sum, norm if self.sync.reports_grad_norm else None, total_tokens)
            with sup.phase("optimizer step"):
                if self.check.bad:
                    self.sync.skip_step()
                else:
                    self.sync.step(metrics["lr"])
                    table = self.report.after_optimizer_step()
                    if table:
                        self._print(table)
                self.sync.after_step()

        with sup.phase(f"step {step + 1}"):
            loss_sum = self.step_fn(batches, total_tokens, update, measure=logged)
        self.state.step += 1
        self.state.tokens_seen += total_tokens
        metrics["loss"] = float(loss_sum) / total_tokens
        if self.check.bad:
            self.state.skipped_steps += 1
            metrics["skipped"] = self.check.reason
        metrics["skipped_steps"] = self.state.skipped_steps
        if self.routing.active:
            metrics.update(self.routing.after_step(logged, update_bias=not self.check.bad))
        metrics.update(**self.sync.traffic_metrics(), **self.report.step_metrics(self.state.step, self.tokens_per_step, logged))
        return metrics

    @torch.no_grad()
    def evaluate(self) -> float:
        self.sync.flush()
        t = self.config.train
        self.model.eval()
        batches = [self._local(x, y) for x, y in eval_batches(self.data.val_tokens, t.seq_len, t.micro_batch_size,
                                                                t.eval_batches)]
        with self.supervisor.phase("evaluation"), announce(f"evaluating {len(batches)} batches", self._print):
            loss_sum, tokens = self.step_fn.evaluate(batches)
        self.model.train()
        return loss_sum / tokens

    def save(self) -> Path | None:
        """Write a checkpoint (every training rank calls this); None if the states are not finite (never saved)."""
        self.sync.flush()
        params, _, optimizer_states = self.sync.model_state_tensors()
        if self.config.guard.enabled and not states_finite(params + optimizer_states, self.mesh.trainer_group(),
                                                           self.dims.world_size > 1):
            return None
        if self.routing.active:
            self.state.expert_bias = self.routing.biases()
        with announce(f"saving checkpoint step {self.state.step}", self._print):
            return self.checkpoints.save(self.parallel, self.state, self.config_dict(), self.data.tokenizer)

    def config_dict(self) -> dict:
        resolved = self.config.to_dict()
        resolved["model"] = dataclasses.asdict(self.model_config)
        return resolved

    def fit(self) -> TrainResult:
        """Train to `train.steps`, evaluating, logging and checkpointing on the way."""
        t, c, log = self.config.train, self.config.checkpoint, self.config.logging
        if self.state.step >= t.steps:
            self._print(f"the run in {self.output_dir} is complete: {self.resumed_from} is at step {self.state.step} of "
                        f"train.steps = {t.steps}; nothing to do (raise train.steps to train on)")
            self.close()
            return completed_result(self.output_dir, self.state.step, self.resumed_from)
        metrics = MetricsLogger(self.output_dir, log.tensorboard, self.state.step, self.resumed_from,
                                self.supervisor.attempt) if self.is_rank0 else None
        self._print(f"model {self.model_config.name}: {count_parameters(self.model_config).total:,} parameters, "
                    f"{self.flops_per_token / 1e6:.1f} MFLOP/token; {self.tokens_per_step:,} tokens/step; "
                    f"{self.env.world_size} rank(s), {self.dims.describe_degrees()}; {self.sync.describe()}; "
                    f"{self.report.describe_peak(self.peak_source)}"
                    + (f"; resumed from {self.resumed_from}" if self.resumed_from else ""))
        if self.model_config.n_experts:
            self._print(describe_experts(self.model_config, self.config, self.dims))
        if self.report.describe_pipeline():
            self._print(self.report.describe_pipeline())
        losses: list[float] = []
        val_loss, last_checkpoint = None, self.resumed_from
        bar = tqdm(total=t.steps, initial=self.state.step, disable=not (self.is_rank0 and log.progress),
                   desc="train", unit="step", dynamic_ncols=True)
        while self.state.step < t.steps:
            values = self.train_step()
            step = self.state.step
            bar.update(1)
            if "skipped" not in values:
                losses.append(values["loss"])
            if metrics and ("tokens_per_s" in values or "skipped" in values):
                metrics.log(step, {**values, "tokens_seen": self.state.tokens_seen})
            if "tokens_per_s" in values:
                bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{values['tokens_per_s']:,.0f}")
                for note in self.report.take_notes():
                    self._print(note)
            if self._after_step(step, values):
                if metrics:
                    metrics.mark("rollback", self.state.step)
                bar.n = self.state.step
                continue
            if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                val_loss = self.evaluate()
                if metrics:
                    metrics.log(step, {"val_loss": val_loss})
                self._print(f"step {step}: validation loss {val_loss:.4f}")
            if c.enabled and ((c.every and step % c.every == 0) or step == t.steps):
                saved = self.save()
                last_checkpoint = saved or last_checkpoint
                if saved is None and self._roll_back(step, "model states are not finite (not saved)", step):
                    if metrics:
                        metrics.mark("rollback", self.state.step)
                    bar.n = self.state.step
        bar.close()
        if metrics:
            metrics.close()
        return self._finish(losses, val_loss, last_checkpoint)

    def _after_step(self, step: int, values: dict) -> bool:
        """The guard's verdict on the step just run; True when it rolled back (the loop goes on from there)."""
        if "skipped" in values:
            self._print(f"step {step}: {values['skipped']}: update skipped ({self.state.skipped_steps} so far)")
        if self.supervisor.after_step(self.check, self.state.rollbacks, self.sync.can_skip) is Action.ROLLBACK:
            return self._roll_back(step, self.check.reason, step - self.config.guard.max_bad_steps + 1)
        return False

    def _roll_back(self, step: int, reason: str, first_bad: int) -> bool:
        self.state = self.checkpoints.rollback(self.parallel, self.state, step, reason, first_bad)
        self.routing.load_biases(self.state.expert_bias)
        return True

    def _finish(self, losses: list[float], val_loss: float | None, checkpoint: Path | None) -> TrainResult:
        log = self.config.logging
        baseline = unigram_cross_entropy(self.data.train_tokens, self.data.val_tokens, self.data.tokenizer.vocab_size)
        metrics_path = self.output_dir / "metrics.jsonl"
        plot = plot_losses(metrics_path, self.output_dir / "loss.png", baseline) if self.is_rank0 and log.plot else None
        if self.is_rank0 and log.plot and self.model_config.n_experts:
            self._print(f"expert load: {plot_expert_load(metrics_path, self.output_dir / 'expert_load.png')}")
        self.sync.flush()  # a deferred update (priority schedule) lands before the sample (every rank)
        sample = final_sample(self.model, self.data.tokenizer, self.config, self.dims, self.is_rank0,
                              self.sync.gathers_in_forward, self._print)
        final = losses[-1] if losses else float("nan")
        checkpoint = self.close() or checkpoint
        self._print(self.report.summary(final, val_loss, baseline, checkpoint, metrics_path, plot, sample,
                                        self.state.skipped_steps, self.state.rollbacks))
        return TrainResult(self.state.step, final, val_loss, baseline, checkpoint, metrics_path, plot, sample, losses)
