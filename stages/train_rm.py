"""`rlkit train-rm`: a reward model from preference pairs (Bradley-Terry), with a sanity report.

Reads a base checkpoint (usually the SFT policy) and a prefs table (`rlkit build-prefs`). Writes a
Hugging Face `AutoModelForSequenceClassification` (num_labels=1) directory: a scalar head on the
hidden state of the last non-pad token of prompt + response, loadable with plain transformers.
Loss -log sigmoid(s_chosen - s_rejected - margin). The figure to trust is held-out pair accuracy,
not the loss. Before any RL uses the model, a sanity report asks whether it learned the task or a
shortcut: correlation of score with response length, short-correct vs long-wrong answers, and the
score of an empty response; a high length correlation is warned about loudly. Under torchrun it
trains data-parallel (FSDP2, `rlkit.training.distributed`); rank 0 writes the gathered model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from rlkit import stage_options
from rlkit.io.tracking import TrackingConfig
from rlkit.options import (
    TRACKING,
    TRAIN,
    Device,
    Force,
    Metrics,
    NoPlan,
    NoVerify,
    OutDir,
    Resume,
    SaveSteps,
    Seed,
    TrustRemoteCode,
)
from rlkit.stage_options import nested, option
from rlkit.training import TrainOptions

LENGTH_CORR_WARN = 0.5
# the loss the progress line shows and `final_loss` records: the mean of the last this many optimizer
# steps' losses (one step's, over a few pairs, is noisy)
LOSS_WINDOW = 10


@dataclass(frozen=True)
class TrainRmConfig:
    base: Path = option(..., "--model", panel="Model", help="Checkpoint to start from (usually the SFT policy).")
    prefs: str = option(..., "--prefs", panel="Data", help="Preference table from `rlkit build-prefs` (or .parquet/.jsonl with prompt/chosen/rejected/split).")
    out: Path = option(..., OutDir)
    epochs: int = option(3, min=1, panel="Optimization", help="Passes over the train pairs.")
    # fine-tuning a pretrained policy: 5e-4 wrecked what SFT taught it (docs/rlhf.md)
    lr: float = option(5e-5, panel="Optimization", help="AdamW peak learning rate (linear decay to 10%).")
    batch_size: int = option(32, min=1, panel="Optimization", help="Pairs per optimizer step.")
    margin: float = option(0.0, panel="Algorithm", help="Bradley-Terry margin: -log sigmoid(s_c - s_r - margin).")
    max_length: int = option(256, min=8, panel="Data", help="Longest prompt + response in tokens (keeps the end).")
    seed: int = option(0, Seed)
    metrics: Path | None = option(None, Metrics)  # append the run's metrics as one JSON line
    tracking: TrackingConfig = nested(TRACKING)  # --report-to, --run-name, --project, --tensorboard
    # a training row (loss, lr, grad norm) to the trackers every this many steps
    logging_steps: int = option(10, min=1, panel="Output & tracking", help="With --report-to: log the training loss, learning rate and gradient norm every this many optimizer steps (as train-rm/train/*).")
    device: str = option("auto", Device)
    train: TrainOptions = nested(TRAIN)  # --dtype, --gradient-checkpointing, --micro-batch-*, --packing, --lora-*
    plan: bool = option(True, NoPlan, invert=True)  # --no-plan: no memory plan when it starts on a GPU
    trust_remote_code: bool = option(False, TrustRemoteCode)
    verify: bool = option(True, NoVerify, invert=True)  # --no-verify: no hash check of the base (never for a reference)
    # a resume snapshot beside --out every this many steps (rlkit.training.resume); 0: none
    save_steps: int = option(0, SaveSteps)
    resume: str = option("auto", Resume)  # auto|must|never: what to do with a snapshot a stopped run left
    force: bool = option(False, Force)
    # no flags: train-rm's own; AdamW's other settings are rlkit's defaults (rlkit.training.Optim)
    weight_decay: float = 0.01
    grad_clip: float = 1.0


def run(cfg: TrainRmConfig) -> Path:
    """Claims --out (see `claims.claim_out`: never over an input, one writer) and runs the stage."""
    from rlkit import devices

    devices.parse(cfg.device)
    from rlkit.io import checkpoints, claims, tracking

    side = {"--metrics": (cfg.metrics, "metrics"), **tracking.outputs(cfg.tracking, "train-rm")}
    with claims.claim_out(cfg.out, "model", {"--model": cfg.base, "--prefs": cfg.prefs}, side), \
            checkpoints.verifying(cfg.verify), tracking.Tracking() as tracker:
        return _run(cfg, tracker)


def _run(cfg: TrainRmConfig, tracker) -> Path:
    import json
    import random

    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io import atomic, checkpoints, claims, data, fingerprints, manifests, tracking
    from rlkit.tasks import prefs

    checkpoints.check_model_dir(cfg.base, "base")
    claims.check_out(cfg.out, "model")
    if cfg.lr <= 0:
        raise RlkitError(f"--lr {cfg.lr:g}: expected a learning rate > 0")
    for flag, v in (("--batch-size", cfg.batch_size), ("--epochs", cfg.epochs)):
        if v < 1:
            raise RlkitError(f"{flag} {v}: expected an integer >= 1")
    from rlkit.training import distributed, resume

    tracking.check(cfg.tracking)
    resume.check(cfg.save_steps, cfg.resume, cfg.out)  # and nothing at the snapshot path that is not rlkit's
    from rlkit import devices
    from rlkit.training.runtime import Runtime

    # --device, --dtype and the training flags, checked and made concrete once: what is trained and recorded
    rt = Runtime.resolve(cfg.device, cfg.train, step_rows=cfg.batch_size, step_flag="--batch-size")
    dev, cfg = rt.device, replace(cfg, train=rt.train)
    train_opts = cfg.train
    src = data.load_source(cfg.prefs, "prefs", {})
    inputs = {"base": fingerprints.fingerprint(cfg.base), "prefs": src.fingerprint}
    if manifests.skip_if_current(cfg.out, "train-rm", cfg, inputs):
        return cfg.out
    if cfg.plan and dev.type == "cuda":  # before any weight is read: refused (exit 71) when it cannot fit (rlkit.planner)
        from rlkit import planner

        half = cfg.max_length // 2
        planner.preflight("train-rm", cfg.base, planner.Work(half, cfg.max_length - half, rows=cfg.batch_size),
                          train_opts, dev, flag="--model")
    t = src.table.to_pydict()
    prefs.check_pairs(src.label, t["prompt"], t["chosen"], t["rejected"])
    train = [i for i, s in enumerate(t["split"]) if s != "heldout"]
    held = [i for i, s in enumerate(t["split"]) if s == "heldout"]
    if not train or not held:
        raise RlkitError(f"{src.label}: need pairs in both splits (train {len(train)}, heldout {len(held)}); "
                         "build-prefs marks --eval-fraction of the prompts as heldout")

    import torch

    from rlkit.ops.preference import pair_accuracy
    from rlkit.scorers.reward_model import encode_pairs, score_texts, seq_scores_local
    from rlkit.training import Optim
    from rlkit.training.engine import Engine
    from rlkit.training.supervised import BradleyTerry, fit

    rt = rt.joined()  # torchrun's process group, when started by torchrun
    dp = rt.dp
    torch.manual_seed(cfg.seed)
    model, tok = _load_base(cfg)
    chosen = encode_pairs(tok, t["prompt"], t["chosen"], cfg.max_length)
    rejected = encode_pairs(tok, t["prompt"], t["rejected"], cfg.max_length)
    _check_budget(cfg, src.label, t, chosen, rejected, train)
    rng = random.Random(cfg.seed)  # the batch order of every epoch, drawn up front: a resumed run skips ahead
    lengths = [max(len(chosen[i]), len(rejected[i])) for i in train]
    epochs = [length_grouped_batches(train, lengths, cfg.batch_size, rng) for _ in range(cfg.epochs)]
    steps = sum(len(e) for e in epochs)
    snaps = resume.Snapshots("train-rm", cfg.out, cfg, inputs, cfg.save_steps, dp=dp, mode=cfg.resume)
    snap = snaps.find(steps)  # one line when a snapshot is there: resumed from, or not and why
    objective = BradleyTerry(cfg.margin)
    engine = Engine(model, objective, Optim(lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip),
                    runtime=rt, kind="seq-cls", base=cfg.base, tokenizer=tok,
                    shard_fn=seq_scores_local, name="train-rm",
                    # before sharding: every rank loads the snapshot's full tensors
                    setup=(lambda m: snaps.restore_weights(snap, m)) if snap is not None else None)
    model = engine.model
    devices.reset_peak_memory(dev)
    devices.announce("train-rm", dev, train_opts.dtype)  # once the data is known good: work starts
    tracker.start(resume.tracking_of(cfg.tracking, snap), "train-rm", cfg)  # a resumed run: its tracker run too
    fitted = fit(engine, objective.plan(chosen, rejected, range(len(chosen))), epochs,
                 lambda step: 1 - 0.9 * step / max(1, steps),  # linear decay to 10%
                 name="train-rm", snaps=snaps, snap=snap, tracker=tracker, logging_steps=cfg.logging_steps,
                 show=lambda f: {"loss": _recent_loss(f.losses)})  # its last value is final_loss
    step, losses = len(fitted.losses), fitted.losses
    model.eval()
    prompts = [t["prompt"][i] for i in held]
    sc = score_texts(model, tok, prompts, [t["chosen"][i] for i in held], max_length=cfg.max_length,
                     packed=train_opts.packing)
    sr = score_texts(model, tok, prompts, [t["rejected"][i] for i in held], max_length=cfg.max_length,
                     packed=train_opts.packing)
    metrics = {
        "heldout_pairs": len(held), "train_pairs": len(train), "optimizer_steps": step,
        "padding_fraction": fitted.padding_fraction,
        "heldout_pair_accuracy": pair_accuracy(torch.tensor(sc), torch.tensor(sr)),
        "heldout_mean_margin": sum(c - r for c, r in zip(sc, sr, strict=True)) / len(held),
        "final_loss": _recent_loss(losses),
        **devices.peak_memory(dev),
    }
    if "negative" in t:  # build-prefs says how each pair was made: one overall figure can hide a kind at chance
        kinds: dict[str, list[bool]] = {}
        for i, c, r in zip(held, sc, sr, strict=True):
            kinds.setdefault(t["negative"][i], []).append(c > r)
        metrics["heldout_pair_accuracy_by_kind"] = {k: sum(v) / len(v) for k, v in sorted(kinds.items())}
    sanity = sanity_report(model, tok, [t["prompt"][i] for i in held], [t["chosen"][i] for i in held],
                           [t["rejected"][i] for i in held], [t.get("answer", [None] * len(t["prompt"]))[i] for i in held],
                           sc, sr, cfg.max_length)
    full = distributed.full_model_state(model) if dp is not None else None  # gathered: a collective
    if distributed.stand_down(dp, metrics):
        return cfg.out
    manifest = manifests.make_manifest("reward-model", "train-rm", cfg, inputs, metrics=metrics, sanity=sanity,
                                       **devices.manifest_entry(dev), **tracker.manifest_entry())
    from rlkit.io import metrics_log

    row = {"stage": "train-rm", "out": str(cfg.out), "step": 0, **metrics}
    # the row first, taken back out if the checkpoint is not written: never one without the other
    with metrics_log.appending(row, cfg.metrics), atomic.atomic_dir(cfg.out) as tmp:
        checkpoints.save_model(model, tok, tmp, manifest, state_dict=full)
    snaps.remove()  # --out holds the result now
    tracker.log(row)
    _show(metrics, sanity)
    console.info(f"train-rm: -> {cfg.out}  " + json.dumps({"heldout_pair_accuracy": round(metrics["heldout_pair_accuracy"], 4)}))
    distributed.barrier(dp)
    return cfg.out


def _check_budget(cfg: TrainRmConfig, label: str, t: dict, chosen, rejected, train: list[int]) -> None:
    """--micro-batch-tokens must hold each train pair (both sides run in one forward pass): one line naming the
    first pair that does not fit."""
    from rlkit.errors import RlkitError

    budget = cfg.train.micro_batch_tokens
    if budget is None:
        return
    for i in train:
        n = len(chosen[i]) + len(rejected[i])
        if n > budget:
            raise RlkitError(f"{label}: row {i} (a pair of {len(chosen[i])} + {len(rejected[i])} tokens, chosen and "
                             f"rejected, which run in one forward pass) is longer than --micro-batch-tokens {budget}; "
                             f"raise --micro-batch-tokens to at least {n}, or lower --max-length")


def length_grouped_batches(items: list[int], lengths: list[int], batch_size: int, rng) -> list[list[int]]:
    """Shuffled batches of similar-length items (HF Trainer's group_by_length): shuffle, sort each run of
    50 batches by length, cut into batches, shuffle the batches. Short and long answers then rarely share
    a padded batch, which on the verbose-vs-terse pairs of build-prefs halves the padded tokens."""
    order = list(range(len(items)))
    rng.shuffle(order)
    mega = 50 * batch_size
    batches = []
    for s in range(0, len(order), mega):
        chunk = sorted(order[s : s + mega], key=lambda j: lengths[j])
        batches += [[items[j] for j in chunk[b : b + batch_size]] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _load_base(cfg: TrainRmConfig):
    import torch
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from rlkit import console
    from rlkit.io import checkpoints

    checkpoints.quiet_transformers()
    tok = checkpoints.load_tokenizer(cfg.base, cfg.trust_remote_code)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialized" is the point here
    try:
        from rlkit.io import adapters

        if adapters.is_adapter_dir(cfg.base):  # LoRA trains on: a policy's adapter on its base, with a new score head
            model = adapters.load(cfg.base, "seq-cls", trust_remote_code=cfg.trust_remote_code)
        else:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(cfg.base), num_labels=1, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code,
                use_safetensors=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    if model.config.pad_token_id is None:
        console.warn(f"{cfg.base} has no pad token; using its eos token ({tok.eos_token!r}) to pad")
    model.config.pad_token_id = tok.pad_token_id
    return model, tok


def sanity_report(model, tok, prompts, chosen, rejected, answers, sc, sr, max_length: int) -> dict:
    """Does the model score the task or a shortcut? Figures over the held-out pairs."""
    import random

    import torch

    from rlkit.scorers.reward_model import score_texts
    from rlkit.tasks import prefs

    responses = [*chosen, *rejected]
    scores = torch.tensor([*sc, *sr], dtype=torch.float64)
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.float64)
    corr = float(torch.corrcoef(torch.stack([scores, lengths]))[0, 1]) if lengths.std() > 0 else 0.0
    report: dict = {"length_correlation": corr, "mean_score_chosen": sum(sc) / len(sc),
                    "mean_score_rejected": sum(sr) / len(sr)}
    report["mean_score_empty"] = sum(score_texts(model, tok, prompts, [""] * len(prompts), max_length=max_length)) / len(prompts)
    gold = [(p, a) for p, a in zip(prompts, answers, strict=True) if a is not None and a.lstrip("-").isdigit()]
    if gold:
        rng = random.Random(0)
        short_right = score_texts(model, tok, [p for p, _ in gold], [a for _, a in gold], max_length=max_length)
        long_wrong = score_texts(model, tok, [p for p, _ in gold],
                                 [prefs.verbose(prefs.near_miss(int(a), rng), rng) for _, a in gold], max_length=max_length)
        report.update(mean_score_short_correct=sum(short_right) / len(gold),
                      mean_score_long_wrong=sum(long_wrong) / len(gold),
                      short_correct_beats_long_wrong=sum(a > b for a, b in zip(short_right, long_wrong, strict=True)) / len(gold))
    report["length_bias_warning"] = abs(corr) > LENGTH_CORR_WARN
    return report


def _recent_loss(losses: list[float]) -> float:
    window = losses[-LOSS_WINDOW:]
    return sum(window) / len(window)


def _show(metrics: dict, sanity: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    from rlkit import console

    def fig(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    # held-out accuracy with its split by kind of negative right under it, then the training figures: the
    # loss is the progress line's last value (LOSS_WINDOW), never read as an accuracy
    t = Table(title="reward model", show_header=False)
    t.add_row("heldout_pair_accuracy", fig(metrics["heldout_pair_accuracy"]))
    for kind, acc in metrics.get("heldout_pair_accuracy_by_kind", {}).items():
        t.add_row(f"  by kind: {escape(str(kind))}", fig(acc))  # a prefs file's own kinds may hold [brackets]
    for k in ("heldout_mean_margin", "heldout_pairs"):
        t.add_row(k, fig(metrics[k]))
    t.add_section()
    t.add_row("train_pairs", fig(metrics["train_pairs"]))
    t.add_row("optimizer_steps", fig(metrics["optimizer_steps"]))
    window = min(LOSS_WINDOW, metrics["optimizer_steps"])
    t.add_row(f"final_loss (mean of the last {window} steps)", fig(metrics["final_loss"]))
    t.add_section()
    for k in ("length_correlation", "mean_score_chosen", "mean_score_rejected", "mean_score_short_correct",
              "mean_score_long_wrong", "short_correct_beats_long_wrong", "mean_score_empty"):
        if k in sanity:
            t.add_row(k, f"{sanity[k]:.4g}")
    console.err.print(t)
    if sanity["length_bias_warning"]:
        console.warn(f"REWARD MODEL LENGTH BIAS: its scores correlate with response length "
                     f"(r = {sanity['length_correlation']:+.2f}, warn above {LENGTH_CORR_WARN}). A policy trained on it "
                     "can raise its reward by writing longer answers; check the preference data (build-prefs --bias?)")


command = stage_options.command(
    TrainRmConfig, "Train a reward model on preference pairs; prints held-out pair accuracy and a sanity report.")
