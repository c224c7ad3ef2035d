"""`fivefold convert --from-hf FOLDER --to RUN_DIR`: a Hugging Face model as a step-0 fivefold run.

The run folder gets what any layout resumes from:

    RUN_DIR/
      step-000000/      a verified checkpoint: the folder's weights, AdamW moments zero (exactly a
                        fresh optimizer), written by the trainer itself under a one-process layout
      tokenizer/        the folder's tokenizer files, byte for byte (chat template included)
      fivefold.toml     the resolved config (model settings from config.json, data.tokenizer =
                        RUN_DIR/tokenizer, checkpoint.resume = auto)

so `fivefold train --config RUN_DIR/fivefold.toml --nproc-per-node 2 --tensor_parallel.degree 2`
continues from it at any tp, pp, cp or ZeRO stage (the checkpoint reshards on load). A step-0
checkpoint has consumed no data, so the data settings and the global batch may change on resume.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fivefold.config import JobConfig, config_toml, load_config
from fivefold.data.tokenizer import BPETokenizer
from fivefold.errors import ConfigError

CONFIG_FILE = "fivefold.toml"


def import_hf(folder: str | Path, run_dir: str | Path, config_path: str | None = None,
              overrides: list[str] | None = None) -> Path:
    """Write RUN_DIR (layout above) from a local Hugging Face folder; returns the checkpoint folder."""
    from fivefold.train.trainer import Trainer

    folder, run_dir = Path(folder).resolve(), Path(run_dir).resolve()
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise ConfigError(f"--to {run_dir} exists and is not empty: choose a new folder (nothing is overwritten)")
    config = load_config(config_path, [*(overrides or []), "--model.init_from_hf", str(folder),
                                       "--train.output_dir", str(run_dir)])
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = run_dir / "tokenizer"
    tokenizer = BPETokenizer.load(config.data.tokenizer)  # a folder's files are kept byte for byte
    tokenizer_dir.mkdir()
    tokenizer.save(tokenizer_dir)
    config.data = dataclasses.replace(config.data, tokenizer=str(tokenizer_dir))
    config.logging = dataclasses.replace(config.logging, progress=False)
    trainer = Trainer(config.validate())
    checkpoint = trainer.save()
    trainer.close()
    saved = trainer.config_dict()
    saved["model"]["init_from_hf"] = ""  # the weights now live in the checkpoint
    saved["checkpoint"]["resume"] = "auto"
    (run_dir / CONFIG_FILE).write_text(f"# written by `fivefold convert --from-hf {folder}`\n" + config_toml(saved))
    if checkpoint is None:
        raise ConfigError(f"{folder} holds non-finite weights: nothing was written to {run_dir}/step-000000")
    return checkpoint


def resumable_config(run_dir: str | Path) -> JobConfig:
    """The config `import_hf` wrote, as `fivefold train --config RUN_DIR/fivefold.toml` reads it."""
    return load_config(Path(run_dir) / CONFIG_FILE)
