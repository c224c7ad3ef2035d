"""The training loop: the same for every layout, single-process or any mix of the five folds.

Everything layout-specific is decided once, before the first step, by `parallelize` (parallel/):
this rank's model part, its gradient sync and its step function. Each optimizer step then:

    batches      this rank's micro-batches of the global batch (the sampler is a pure function of
                 the step; the data-parallel rank picks samples, the context-parallel rank its part
                 of each sequence)
    tokens       target tokens of the step over the sync's loss group (token weighting:
                 loss = sum over ranks and micro-batches of sum_t CE_t / total target tokens)
    step         forward and backward of every micro-batch, then `update`: clip the global
                 gradient norm, set the scheduled learning rate, optimizer step, after-step
    metrics      loss, lr, grad norm, and what reporting reads from the sync and step function
    evaluation and checkpoints at their intervals
With one process this is the reference every layout is tested against.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from fivefold.config import JobConfig
from fivefold.data.dataset import PreparedData, eval_batches, prepare_data, sample_batch, unigram_cross_entropy
from fivefold.errors import CheckpointError, ConfigError
from fivefold.model import ModelConfig, build_model
from fivefold.model.generate import generate
from fivefold.optim import lr_at
from fivefold.parallel.mesh import Mesh, mesh_for
from fivefold.parallel.parallelize import parallelize
from fivefold.parallel.step import target_tokens
from fivefold.parallel.validate import check_config
from fivefold.parallel.tensor_parallel import IGNORE_INDEX  # noqa: F401 - re-exported for tests and users
from fivefold.plan.flops import count_parameters, flops_per_token
from fivefold.train import checkpoint as ckpt
from fivefold.train.distributed import all_reduce_sum, init_distributed, local_device
from fivefold.train.metrics import MetricsLogger, peak_tflops, plot_losses, read_metrics
from fivefold.train.reporting import Reporter
from fivefold.train.train_state import capture_training_state, restore_training_state


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    val_loss: float | None
    unigram_baseline: float
    checkpoint: Path | None
    metrics_path: Path
    plot_path: Path | None
    sample: str | None
    losses: list[float]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = cuda but no CUDA device is available; use auto or cpu")
    return torch.device(name)


def resolve_model_config(model: ModelConfig, vocab_size: int) -> ModelConfig:
    """Fill in the tokenizer's vocabulary size, or check the configured one can hold it."""
    if model.vocab_size == 0:
        return dataclasses.replace(model, vocab_size=vocab_size)
    if model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size = {model.vocab_size} is smaller than the tokenizer's {vocab_size}: "
            "set model.vocab_size = 0 to take the tokenizer's"
        )
    return model


def prepare_data_once(config: JobConfig, world_size: int, is_rank0: bool) -> PreparedData:
    """Rank 0 builds the token cache first; the others then only open it."""
    if world_size > 1 and not is_rank0:
        dist.barrier()
    data = prepare_data(config.data)
    if world_size > 1 and is_rank0:
        dist.barrier()
    return data


class Trainer:
    def __init__(self, config: JobConfig, data: PreparedData | None = None, mesh: Mesh | None = None):
        self.config = check_config(config)
        t = config.train
        self.env = init_distributed(resolve_device(t.device))
        self.is_rank0 = self.env.is_rank0
        self.device = local_device(resolve_device(t.device), self.env)
        self.mesh = mesh or mesh_for(config, self.env.world_size, self.device.type)
        self.dims = self.mesh.dims
        self.output_dir = Path(t.output_dir)
        self.data = data or prepare_data_once(config, self.env.world_size, self.is_rank0)
        self.model_config = resolve_model_config(config.model, self.data.tokenizer.vocab_size)
        torch.manual_seed(t.seed)
        self.autocast_dtype = torch.bfloat16 if t.dtype == "bf16" else None
        self.parallel = parallelize(build_model(self.model_config), self.mesh, config, self.device, self._autocast)
        self.model, self.sync, self.step_fn = self.parallel.model, self.parallel.sync, self.parallel.step
        self.state = ckpt.TrainerState(step=0, tokens_seen=0, seed=t.seed)
        self.tokens_per_step = t.micro_batch_size * t.grad_accum_steps * self.dims.dp * t.seq_len
        self.flops_per_token = flops_per_token(self.model_config, t.seq_len)
        peak, self.peak_source = peak_tflops(self.device, t.peak_tflops)
        self.report = Reporter(config, self.parallel, self.env.world_size, self.flops_per_token, peak, self.device,
                               self.output_dir)
        self.resumed_from = self._resume_folder()
        if self.resumed_from is not None:  # saved under any layout: read what this one needs
            restore_training_state(self.resumed_from, self.parallel, ckpt.load_layout(self.resumed_from))
            self.state = ckpt.load_trainer_state(self.resumed_from)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.sync.optimizer

    def _resume_folder(self) -> Path | None:
        """The checkpoint to resume from, checked against this run's model settings."""
        folder = ckpt.resolve_resume(self.config.checkpoint.resume, self.output_dir)
        if folder is None:
            return None
        saved = ckpt.load_config_dict(folder)
        current = dataclasses.asdict(self.model_config)
        diffs = [k for k in current if k != "name" and saved.get("model", {}).get(k, current[k]) != current[k]]
        if diffs:
            raise CheckpointError(
                f"checkpoint {folder} was trained with different model settings ({', '.join('model.' + d for d in diffs)}); "
                "resume with the same model config or start a new train.output_dir"
            )
        ckpt.check_layout(folder, ckpt.load_layout(folder), self.parallel.layout)
        return folder

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """This rank's (inputs, labels, positions) micro-batches of optimizer step `step`."""
        t = self.config.train
        return [
            self._local(*sample_batch(self.data.train_tokens, t.seq_len, t.micro_batch_size, t.seed, step, i,
                                      t.grad_accum_steps, self.parallel.dp_rank, self.dims.dp))
            for i in range(t.grad_accum_steps)
        ]

    def _local(self, inputs: torch.Tensor, labels: torch.Tensor):
        return self.parallel.folds.shard_sequence(inputs.to(self.device), labels.to(self.device))

    def train_step(self) -> dict[str, float]:
        """One optimizer step at `self.state.step`; returns its metrics."""
        t = self.config.train
        step = self.state.step
        batches = self.micro_batches(step)
        local = torch.tensor(float(target_tokens(batches)), device=self.device)
        total_tokens = int(all_reduce_sum(local, self.sync.loss_group))
        logged = (step + 1) % t.log_every == 0 or step + 1 == t.steps
        metrics = {"lr": lr_at(step, self.config.optim, t.steps)}

        def update() -> None:  # the gradients are final: clip, step, report once, after-step
            metrics["grad_norm"] = self.sync.clip_grad_norm_(t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
            self.sync.step(metrics["lr"])
            table = self.report.after_optimizer_step()
            if table:
                self._print(table)
            self.sync.after_step()

        loss_sum = self.step_fn(batches, total_tokens, update, measure=logged)
        self.state.step += 1
        self.state.tokens_seen += total_tokens
        metrics["loss"] = float(loss_sum) / total_tokens
        metrics.update(self.report.step_metrics(self.state.step, self.tokens_per_step, logged))
        return metrics

    @torch.no_grad()
    def evaluate(self) -> float:
        self.sync.flush()
        t = self.config.train
        self.model.eval()
        batches = [self._local(x, y) for x, y in eval_batches(self.data.val_tokens, t.seq_len, t.micro_batch_size,
                                                                t.eval_batches)]
        loss_sum, tokens = self.step_fn.evaluate(batches)
        self.model.train()
        return loss_sum / tokens

    def save(self) -> Path:
        """Write a checkpoint; in a distributed run every training rank must call this (each writes its part)."""
        self.sync.flush()
        group = self.mesh.named.get("workers")
        return ckpt.save_checkpoint(
            self.output_dir, capture_training_state(self.parallel), self.parallel.layout, self.state,
            self.config_dict(), self.data.tokenizer, self.config.checkpoint.keep_last,
            group=group, distributed=self.dims.world_size > 1,
        )

    def config_dict(self) -> dict:
        resolved = self.config.to_dict()
        resolved["model"] = dataclasses.asdict(self.model_config)
        return resolved

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        tok = self.data.tokenizer
        generator = torch.Generator().manual_seed(self.config.train.seed)
        self.model.eval()
        ids = generate(self.model, tok.encode(prompt), max_new_tokens, temperature=0.8, top_k=40,
                       eos_id=tok.eos_id, generator=generator)
        self.model.train()
        return prompt + tok.decode(ids)

    def fit(self) -> TrainResult:
        """Train to `train.steps`, evaluating, logging and checkpointing on the way."""
        t, c, log = self.config.train, self.config.checkpoint, self.config.logging
        if self.is_rank0:
            self._trim_metrics()
        metrics = MetricsLogger(self.output_dir, log.tensorboard) if self.is_rank0 else None
        self._print(
            f"model {self.model_config.name}: {count_parameters(self.model_config).total:,} parameters, "
            f"{self.flops_per_token / 1e6:.1f} MFLOP/token; {self.tokens_per_step:,} tokens/step; "
            f"{self.env.world_size} rank(s), {self.dims.describe_degrees()}; {self.sync.describe()}; "
            f"peak {self.report.peak_tflops:.3f} TFLOP/s per rank ({self.peak_source})"
            + (f"; resumed from {self.resumed_from}" if self.resumed_from else "")
        )
        if self.report.describe_pipeline():
            self._print(self.report.describe_pipeline())
        losses: list[float] = []
        val_loss, last_checkpoint = None, self.resumed_from
        bar = tqdm(total=t.steps, initial=self.state.step, disable=not (self.is_rank0 and log.progress),
                   desc="train", unit="step", dynamic_ncols=True)
        while self.state.step < t.steps:
            values = self.train_step()
            losses.append(values["loss"])
            step = self.state.step
            bar.update(1)
            if "tokens_per_s" in values:
                values["tokens_seen"] = self.state.tokens_seen
                if metrics:
                    metrics.log(step, values)
                bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{values['tokens_per_s']:,.0f}",
                                mfu=f"{values['mfu']:.1%}")
                for note in self.report.take_notes():
                    self._print(note)
            if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                val_loss = self.evaluate()
                if metrics:
                    metrics.log(step, {"val_loss": val_loss})
                self._print(f"step {step}: validation loss {val_loss:.4f}")
            if c.enabled and ((c.every and step % c.every == 0) or step == t.steps):
                last_checkpoint = self.save()
        bar.close()
        self.sync.flush()
        if metrics:
            metrics.close()
        return self._finish(losses, val_loss, last_checkpoint)

    def _finish(self, losses: list[float], val_loss: float | None, checkpoint: Path | None) -> TrainResult:
        log = self.config.logging
        baseline = unigram_cross_entropy(self.data.train_tokens, self.data.val_tokens, self.data.tokenizer.vocab_size)
        metrics_path = self.output_dir / "metrics.jsonl"
        plot = plot_losses(metrics_path, self.output_dir / "loss.png", baseline) if self.is_rank0 and log.plot else None
        # A sync that gathers weights inside forward (ZeRO-3) needs every rank to generate.
        split = self.dims.tp > 1 or self.dims.cp > 1 or self.dims.pp > 1  # no rank holds the whole model or sequence
        asked = bool(log.sample_prompt and log.sample_tokens)
        if asked and split:
            self._print("sample: generation runs in one process; use `fivefold generate --checkpoint` on this run")
        wanted = asked and not split and (self.is_rank0 or self.sync.gathers_in_forward)
        sample = self.sample(log.sample_prompt, log.sample_tokens) if wanted else None
        final = losses[-1] if losses else float("nan")
        self._print(f"final train loss {final:.4f}" + (f", validation loss {val_loss:.4f}" if val_loss is not None else "")
                    + f"; unigram baseline {baseline:.4f} nats/token")
        self._print(f"checkpoint: {checkpoint}\nmetrics:    {metrics_path}" + (f"\nplot:       {plot}" if plot else "")
                    + (f"\ntensorboard: {self.output_dir / 'tensorboard'}" if log.tensorboard else ""))
        if sample is not None:
            self._print("sample:\n" + "-" * 60 + f"\n{sample}\n" + "-" * 60)
        return TrainResult(self.state.step, final, val_loss, baseline, checkpoint, metrics_path, plot, sample, losses)

    def _trim_metrics(self) -> None:
        """On resume, drop metric records past the resumed step so the log reads as one run."""
        path = self.output_dir / "metrics.jsonl"
        records = read_metrics(path)
        if records and any(r["step"] > self.state.step for r in records):
            kept = [r for r in records if r["step"] <= self.state.step]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def _print(self, text: str) -> None:
        if self.is_rank0:
            tqdm.write(text)
