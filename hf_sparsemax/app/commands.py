"""The recipe commands behind ``hf-sparsemax train | evaluate | generate | compare``.

Folders are written atomically: work happens in ``<folder>.partial`` and is
renamed to ``<folder>`` only when everything succeeded, so a failed or
interrupted run never leaves a half-written report or model. Training
checkpoints live in the ``.partial`` folder; ``resume=True`` continues from
the last one (and ``compare`` skips the variants that had finished); a run
that fails before it has anything to resume from removes its ``.partial``
folder again. Everything that can be checked before a model is loaded (the
recipe, every variant's settings, the training arguments, the data source,
the output folder, the model's location) is checked first. One run per output
folder at a time: a second one is refused at once (:mod:`.run_lock`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import time
from typing import Any

from . import runner
from .recipe_data import causal_lm_datasets, check_source, classification_datasets
from .recipes import Recipe, RecipeError, Variant
from .run_lock import missing_folders, output_lock, remove_empty


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def default_output(recipe: Recipe) -> str:
    return os.path.join("runs", recipe.name)


def start_work(work: str, resume: bool) -> None:
    """Create (or, with ``resume``, keep) the ``.partial`` work folder."""
    if is_main_process():
        if os.path.isdir(work) and not resume:
            shutil.rmtree(work)
        os.makedirs(work, exist_ok=True)
    barrier()


def resumable(work: str) -> bool:
    """Whether a work folder holds something ``resume`` can use: a complete checkpoint or a finished variant."""
    for folder, folders, files in os.walk(work):
        if "results.json" in files or any(complete_checkpoint(os.path.join(folder, f)) for f in folders):
            return True
    return False


def complete_checkpoint(folder: str) -> bool:
    """A Trainer checkpoint folder whose last file, ``trainer_state.json``, was written."""
    return os.path.basename(folder).startswith("checkpoint-") and os.path.isfile(
        os.path.join(folder, "trainer_state.json"))


def drop_incomplete_checkpoints(work: str) -> list[str]:
    """Remove checkpoint folders a failed write left half-done (``--resume`` would load them); their names."""
    dropped = []
    for folder, folders, _ in os.walk(work):
        for name in folders:
            path = os.path.join(folder, name)
            if name.startswith("checkpoint-") and not complete_checkpoint(path):
                shutil.rmtree(path, ignore_errors=True)
                dropped.append(name)
    return dropped


@contextlib.contextmanager
def discard_on_failure(work: str):
    """If the block fails, remove the work folder it made again, unless it is :func:`resumable`.

    A checkpoint left half-written (the disk filled up while Trainer saved
    it) is removed first, and the failure becomes one ``OSError`` line saying so.
    """
    created = missing_folders(work)
    try:
        yield
    except BaseException as error:
        dropped = drop_incomplete_checkpoints(work) if is_main_process() else []
        kept = resumable(work)
        if is_main_process() and not kept:
            shutil.rmtree(work, ignore_errors=True)
            remove_empty(created)
        if kept and isinstance(error, KeyboardInterrupt) and is_main_process():
            print(f"hf-sparsemax: interrupted; --resume continues from the last checkpoint in {work}", flush=True)
        if dropped and isinstance(error, (OSError, RuntimeError)):
            then = f"--resume continues from the last complete checkpoint in {work}" if kept else "nothing was kept"
            raise OSError(f"writing {dropped[0]} failed, is the disk full? ({error}); free some space and run "
                          f"again ({then})") from error
        raise


def locked(folder: str, what: str):
    """The output folder's lock (:func:`~hf_sparsemax.app.run_lock.output_lock`), taken by the main process only."""
    return output_lock(folder, what) if is_main_process() else contextlib.nullcontext()


def note_replacement(final: str) -> None:
    if is_main_process() and os.path.isdir(final):
        print(f"hf-sparsemax: note: {final} holds a finished result; this run replaces it when it completes",
              flush=True)


def publish(work: str, final: str) -> None:
    """Rename the finished work folder to its final name, replacing an older result (and saying so)."""
    barrier()
    if not is_main_process():
        return
    old = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        print(f"hf-sparsemax: replaced the earlier result in {final}", flush=True)
    os.rename(work, final)
    shutil.rmtree(old, ignore_errors=True)


def check_output(folder: str) -> None:
    """The output folder is a folder (or can be made) in a writable place."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise RecipeError(f"--output {folder} is a file, not a folder: choose another --output")
    existing = os.path.dirname(os.path.abspath(folder))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"cannot write the output folder {folder}: {existing} is not a writable folder; "
                          "choose another --output")


def check_fsdp_device(recipe: Recipe, variant: Variant) -> None:
    """FSDP asked for (``accelerate launch --use_fsdp`` or ``training.fsdp``) where training runs on CPU is refused.

    accelerate (1.15) turns FSDP on only for GPU-like devices; on CPU the processes silently train as plain
    DDP (``DistributedType.MULTI_CPU``), or each alone when ``use_cpu`` is off, so the run would not be what
    was asked for. (torch's own ``fully_shard`` does shard on CPU with gloo: see tests/test_fsdp.py.)
    """
    import torch

    args = recipe.training_args(variant)
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or bool(args.get("fsdp"))
    if asked and (args.get("use_cpu") or not torch.accelerator.is_available()):
        raise RecipeError("FSDP was asked for (accelerate launch --use_fsdp or training.fsdp), but training runs on "
                          "CPU, where accelerate does not shard (the processes would train as plain DDP): launch "
                          "with --multi_gpu for DDP on CPU, or on GPUs with --set training.use_cpu=false")


def check(recipe: Recipe, variants: list[Variant], output: str) -> None:
    """Everything checkable before loading: each variant's training arguments, data, output folder, model location."""
    for variant in variants:
        check_fsdp_device(recipe, variant)
        args = runner.training_arguments(recipe, variant, "unused")  # builds nothing on disk
        args.world_size  # sets up the process group under `accelerate launch`, so barrier() works from here on
    check_source(recipe.data)
    check_output(output)
    runner.model_location(recipe.model)


def load_everything(recipe: Recipe):
    """``(tokenizer, train set, held-out set, labels or None, base model)``."""
    tokenizer = runner.load_tokenizer(recipe)
    labels = None
    if recipe.task == "sequence_classification":
        train_set, eval_set, labels = classification_datasets(recipe.data, tokenizer)
    else:
        train_set, eval_set = causal_lm_datasets(recipe.data, tokenizer)
    return tokenizer, train_set, eval_set, labels, runner.load_base_model(recipe, labels)


def run_variant(recipe: Recipe, variant: Variant, base_model, tokenizer, train_set, eval_set, labels, work: str,
                resume: bool, heatmap: bool, long=None) -> tuple[dict[str, Any], Any]:
    """Train, evaluate and (causal LM) sample one variant in ``work``; returns its results and attention map.
    ``long``: ``(held-out documents, LongSpec)``, the evaluation at length (:mod:`.long_context`). The results'
    ``part_seconds``: ``{part: [wall, cpu]}`` seconds of each part (:func:`.runner.timed`)."""
    parts: dict[str, list[float]] = {}
    with runner.timed(parts, "prepare"):
        model, custom_loss = runner.prepare(runner.fresh_copy(base_model), recipe, variant)
    fitted = {}
    if variant.calibrate is not None:
        with runner.timed(parts, "calibrate"):
            fitted = runner.calibrate(model, variant, train_set, recipe.training_args(variant).get("per_device_train_batch_size", 8))
    if variant.transfer is not None:
        with runner.timed(parts, "transfer"):
            fitted = runner.transfer(model, variant, train_set)
    trainer = runner.make_trainer(recipe, variant, model, tokenizer, train_set, eval_set, work,
                                  num_labels=len(labels) if labels else None, custom_loss=custom_loss)
    results: dict[str, Any] = {"variant": variant.name, "attn": describe(variant.attn, variant.attn_options),
                               "loss": describe(variant.loss, variant.loss_options),
                               "seed": recipe.training_args(variant).get("seed")}
    for key in ("alpha_learning_rate", "scale_learning_rate"):
        if getattr(variant, key) is not None:
            results[key] = getattr(variant, key)
    results.update(fitted)
    for key in ("alpha_schedule", "distill"):
        if getattr(variant, key) is not None:
            results[key] = getattr(variant, key)
    start_alphas = runner.alphas_by_head(trainer.model)  # as configured: a resumed run loads its checkpoint later
    curve = trainer.hf_sparsemax_curve
    if curve is not None:
        curve.start(trainer.model)  # step 0: the model as patched (and calibrated), before any callback runs
    with runner.timed(parts, "train"):
        results.update(runner.train(trainer, work, resume))
    if curve is not None:
        results.update(curve=curve.points, step0_loss=curve.points[0]["eval_loss"],
                       heldout_attention_zero_share=curve.points[-1]["attention_zero_share"])
    with runner.timed(parts, "evaluate"):
        results.update(runner.evaluate(trainer))
    if curve is None and recipe.task == "causal_lm":  # the held-out zeros the curves' last point would give
        from .curves import measure

        with runner.timed(parts, "evaluate"):
            results["heldout_attention_zero_share"] = measure(trainer.model, eval_set, recipe.eval.curve_blocks,
                                                              recipe.eval.batch_size)["attention_zero_share"]
    results.update(runner.learned_alphas(trainer.model, start_alphas))
    results.update(runner.learned_length_scale(trainer.model))
    attention = None
    if is_main_process():
        runner.save_variant(work, recipe, variant, labels, trainer.model)
        if recipe.task == "causal_lm":
            with runner.timed(parts, "decoders_and_samples"):
                results["decoders"] = score_decoders(trainer.model, recipe, variant, eval_set)
                results.update(runner.sample(trainer.model, tokenizer, recipe))
            if heatmap:
                from .report import head_zero_shares, zero_share

                with runner.timed(parts, "heatmap"):
                    weights, tokens = runner.attention_weights(trainer.model, tokenizer, recipe)
                attention = weights[recipe.eval.heatmap_layer, recipe.eval.heatmap_head], tokens
                results["attention_zero_share"] = zero_share(attention[0])
                if start_alphas is not None:
                    results["attention_zero_heads"] = head_zero_shares(weights)
            if long is not None:
                from . import long_context

                with runner.timed(parts, "long_context"):
                    results.update(long_context.evaluate(trainer.model, tokenizer, *long))
        results["part_seconds"] = parts
        runner.write_json(os.path.join(work, "results.json"), results)
        shutil.rmtree(os.path.join(work, "checkpoints"), ignore_errors=True)
    del trainer, model
    gc.collect()
    return results, attention


def score_decoders(model, recipe: Recipe, variant: Variant, eval_set) -> list[dict[str, Any]]:
    """The held-out metrics of every decoder a user could sample ``variant`` with (:mod:`.decoders`)."""
    from ..decoding.decoders import score_decoders as score
    from .._model import base_model

    return score(model, eval_set, variant.loss, variant.loss_options, base_model(model).config.vocab_size,
                 epsilon=recipe.eval.epsilon, batch_size=recipe.eval.batch_size)


def say(text: str) -> None:
    """One console line of a run (the main process's)."""
    if is_main_process():
        print(f"hf-sparsemax: {text}", flush=True)


def changes(recipe: Recipe, variant: Variant) -> str:
    """What a variant changes against the recipe's own settings, e.g. ``attention -> entmax15``."""
    parts = []
    for what, name, options, base, base_options in (
            ("attention", variant.attn, variant.attn_options, recipe.attn, recipe.attn_options),
            ("loss", variant.loss, variant.loss_options, recipe.loss, recipe.loss_options)):
        if (name, options) != (base, base_options):
            parts.append(f"{what} -> {describe(name, options)}")
    parts += [f"{key} {getattr(variant, key)}" for key in ("alpha_learning_rate", "scale_learning_rate", "calibrate", "transfer",
                                                            "alpha_schedule", "distill") if getattr(variant, key) is not None]
    parts += [f"training.{key}={value}" for key, value in variant.training.items()
              if recipe.training.get(key) != value]
    return ", ".join(parts) or (f"the recipe's own settings ({describe(recipe.attn, recipe.attn_options)} "
                                f"attention, {describe(recipe.loss, recipe.loss_options)} loss)")


def describe(name: str | None, options: dict[str, Any]) -> str:
    text = name or "default"
    return text + ("(" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")" if options else "")


def train_command(recipe: Recipe, variant_name: str | None, output: str | None, resume: bool) -> dict[str, Any]:
    """Fine-tune one variant into ``<output>/<variant>``, evaluate it on the held-out split, sample from it."""
    variant = recipe.variant(variant_name)
    root = output or default_output(recipe)
    check(recipe, [variant], root)
    with locked(root, f"train {recipe.name} --variant {variant.name}"):
        start = time.perf_counter()
        tokenizer, train_set, eval_set, labels, base = load_everything(recipe)
        final = os.path.join(root, variant.name)
        work = final + ".partial"
        note_replacement(final)
        say(f"training {variant.name}: {changes(recipe, variant)}")
        with discard_on_failure(work):
            start_work(work, resume)
            results, _ = run_variant(recipe, variant, base, tokenizer, train_set, eval_set, labels, work, resume,
                                     heatmap=False)
        publish(work, final)
    results["seconds"] = round(time.perf_counter() - start, 1)
    results["folder"] = final
    return results


def evaluate_command(recipe: Recipe, variant_name: str | None, output: str | None) -> dict[str, Any]:
    """Held-out metrics of a trained variant (written to its results.json)."""
    variant = recipe.variant(variant_name)
    root = output or default_output(recipe)
    folder = os.path.join(root, variant.name)
    with locked(root, f"evaluate {recipe.name} --variant {variant.name}"):
        model, tokenizer, trained, custom_loss, info = runner.load_trained(recipe, folder)
        if recipe.task == "sequence_classification":
            _, eval_set, _ = classification_datasets(recipe.data, tokenizer)
        else:
            _, eval_set = causal_lm_datasets(recipe.data, tokenizer)
        trainer = runner.make_trainer(recipe, trained, model, tokenizer, None, eval_set, folder,
                                      num_labels=len(info["labels"]) if info["labels"] else None,
                                      custom_loss=custom_loss)
        results = runner.evaluate(trainer)
        if recipe.task == "causal_lm":
            results["decoders"] = score_decoders(model, recipe, trained, eval_set)
        update_results(folder, results)
    return {"variant": trained.name, "folder": folder, **results}


def generate_command(recipe: Recipe, variant_name: str | None, output: str | None) -> dict[str, Any]:
    """Matched sampling from a trained variant, with the share of zero-probability tokens drawn."""
    if recipe.task != "causal_lm":
        raise RecipeError(f"generate needs a causal_lm recipe; {recipe.name!r} is {recipe.task}")
    variant = recipe.variant(variant_name)
    root = output or default_output(recipe)
    folder = os.path.join(root, variant.name)
    with locked(root, f"generate {recipe.name} --variant {variant.name}"):
        model, tokenizer, trained = runner.load_trained(recipe, folder)[:3]
        results = runner.sample(model, tokenizer, recipe)
        update_results(folder, results)
    return {"variant": trained.name, "folder": folder, "prompts": recipe.eval.prompts, **results}


def update_results(folder: str, new: dict[str, Any]) -> None:
    path = os.path.join(folder, "results.json")
    old = {}
    if os.path.isfile(path):
        old = runner.read_json(path)
    tmp = path + ".tmp"
    runner.write_json(tmp, {**old, **new})
    os.replace(tmp, path)


def compare_command(recipe: Recipe, output: str | None, resume: bool) -> dict[str, Any]:
    """Every variant (and, with ``seeds``, every seed of it) on the same model and split; a report folder with
    table, plots, samples and weights."""
    final = output or default_output(recipe)
    check(recipe, [variant for _, variant in recipe.runs()], final)
    with locked(final, f"compare {recipe.name}"):
        work = final.rstrip("/") + ".partial"
        with discard_on_failure(work):
            return compare_variants(recipe, recipe.runs(), final, work, resume)


def compare_variants(recipe: Recipe, runs: list[tuple[str, Variant]], final: str, work: str,
                     resume: bool) -> dict[str, Any]:
    """Train, evaluate and sample each ``(folder name, variant)`` run in ``work``; write the report; publish."""
    from . import convert_report, long_report, report, seeds

    start = time.perf_counter()
    tokenizer, train_set, eval_set, labels, base = load_everything(recipe)
    long = None
    if recipe.eval.long_context is not None and recipe.task == "causal_lm":
        from .long_context import held_out_documents

        long = (held_out_documents(recipe.eval.long_context, recipe.data, tokenizer), recipe.eval.long_context)
    note_replacement(final)
    start_work(work, resume)
    parent = None if long is None else parent_at_length(base, long, work, resume)
    results, maps, histories, heldout = [], {}, {}, {}
    for number, (folder, variant) in enumerate(runs, 1):
        say(f"[{number}/{len(runs)}] {folder}: {changes(recipe, variant)}")
        vdir = os.path.join(work, folder)
        done = os.path.join(vdir, "results.json")
        if resume and os.path.isfile(done) and os.path.isfile(os.path.join(vdir, "variant.json")):
            result = runner.read_json(done)
            attention = None
            if recipe.task == "causal_lm" and is_main_process() and variant.name not in maps:
                model = runner.load_trained(recipe, vdir).model
                attention = runner.attention_map(model, tokenizer, recipe)
                del model
        else:
            os.makedirs(vdir, exist_ok=True)
            result, attention = run_variant(recipe, variant, base, tokenizer, train_set, eval_set, labels, vdir,
                                            resume, heatmap=True, long=long)
        result["run"] = folder
        results.append(result)
        if attention is not None and variant.name not in maps:  # the heatmap shows each variant's first seed
            maps[variant.name] = attention
        if is_main_process():
            label = f"seed {result.get('seed')}" if recipe.seeds is not None else "train"
            histories.setdefault(variant.name, {})[label] = runner.read_json(os.path.join(vdir, "log_history.json"))
            heldout.setdefault(variant.name, {})[label] = heldout_points(result)
    seconds = time.perf_counter() - start
    firsts = [runs[0] for runs in seeds.by_variant(results).values()]  # each variant's first seed (plots)
    table = results if recipe.seeds is None else seeds.aggregate(results)
    layer = recipe.eval.heatmap_layer % base.config.num_hidden_layers if recipe.task == "causal_lm" else 0
    if is_main_process():
        figures = ["loss_curves.png"]
        report.plot_loss_curves(histories, os.path.join(work, "loss_curves.png"), heldout)
        if maps:
            report.plot_attention(maps, os.path.join(work, "attention_heatmap.png"), layer, recipe.eval.heatmap_head)
            figures.append("attention_heatmap.png")
            report.write_samples(results, recipe.eval.prompts, os.path.join(work, "samples.txt"))
        if recipe.task == "sequence_classification" and report.plot_confusion(
                firsts, os.path.join(work, "confusion_matrix.png")):
            figures.append("confusion_matrix.png")
        if report.plot_learned_alphas(firsts, os.path.join(work, "learned_alphas.png")):
            figures.append("learned_alphas.png")
        if convert_report.plot_curves(results, os.path.join(work, "curves.png")):
            figures.append("curves.png")
        if long_report.plot_passkey(results, os.path.join(work, "passkey_heatmap.png")):
            figures.append("passkey_heatmap.png")
        report.write_report(work, recipe, table, seconds, figures, runs=firsts,
                            extra=convert_report.conversion_section(results) + long_report.section(results, parent),
                            peak_rss=peak_rss(), heatmap=(layer, recipe.eval.heatmap_head))
        runner.write_json(os.path.join(work, "results.json"), table)
        runner.write_json(os.path.join(work, "recipe.json"), recipe.to_dict())
    publish(work, final)
    from .verdict import verdict

    return {"folder": final, "seconds": round(seconds, 1), "results": table, "peak_rss": peak_rss(),
            "verdict": verdict(table, recipe.task, peak_rss())}


def parent_at_length(base, long, work: str, resume: bool) -> dict[str, Any] | None:
    """The untrained parent's held-out cross-entropy by position (:func:`.long_context.parent_at_length`), measured
    once per comparison on the main process into ``<work>/parent_at_length.json`` (read back on ``--resume``)."""
    from . import long_context

    path = os.path.join(work, "parent_at_length.json")
    if resume and os.path.isfile(path):
        return runner.read_json(path)
    if not is_main_process():
        return None
    say("the parent before any training, at length")
    parent = long_context.parent_at_length(base, *long)
    runner.write_json(path, parent)
    return parent


def peak_rss() -> float | None:
    """This process's peak resident memory so far, in bytes (None where ``resource`` is missing: Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1.0 if sys.platform == "darwin" else 1024.0)


def heldout_points(result: dict[str, Any]) -> list[tuple[int, float]]:
    """``[(step, held-out loss)]`` of one run for the loss curves: its curve points, else its final evaluation."""
    if result.get("curve"):
        return [(p["step"], p["eval_loss"]) for p in result["curve"]]
    if result.get("eval_loss") is not None and result.get("steps") is not None:
        return [(result["steps"], result["eval_loss"])]
    return []
