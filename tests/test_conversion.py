"""Converting a softmax model: the alpha schedule (AlphaScheduleCallback) and self-distillation (SelfDistillation)."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import hf_sparsemax as hs
from hf_sparsemax.attention import OPTIONS_ATTR, LearnedAlpha
from hf_sparsemax.attention.interface import attention_modules
from hf_sparsemax.conversion.schedule import scheduled_alpha

HEADS = 4


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def batch(seed=1, size=2, length=12):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (size, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits(model, inputs=None):
    with torch.no_grad():
        return model(**(inputs or batch())).logits


def state(step, max_steps):
    return SimpleNamespace(global_step=step, max_steps=max_steps)


def drive(callback, model, max_steps, upto):
    """Trainer's events for steps 0 .. upto - 1 (on_train_begin, then on_step_begin per step)."""
    callback.on_train_begin(None, state(0, max_steps), None, model=model)
    for step in range(1, upto):
        callback.on_step_begin(None, state(step, max_steps), None, model=model)


@pytest.mark.parametrize("target, alpha", [("entmax15", 1.5), ("sparsemax", 2.0)])
def test_the_schedule_ramps_then_ends_on_the_target_mappings_own_path(target, alpha):
    base = tiny_llama()
    model = hs.patch_model(copy.deepcopy(base), attn=target, attn_options={"chunk_size": 8})
    own = [vars(m)[OPTIONS_ATTR] for m in attention_modules(model)]
    callback = hs.AlphaScheduleCallback(share=0.5, start=1.01)  # 10 steps: steps 0-4 on the ramp
    callback.on_train_begin(None, state(0, 10), None, model=model)
    for step in range(5):
        callback.on_step_begin(None, state(step, 10), None, model=model)
        expected = 1.01 + (alpha - 1.01) * step / 5
        assert callback.alpha == pytest.approx(expected, abs=1e-12)
        assert model.config._attn_implementation == "entmax_bisect"
        options = vars(attention_modules(model)[0])[OPTIONS_ATTR]
        assert options.alpha == callback.alpha and options.chunk_size == 8  # the attention's own options kept
        ramp = hs.patch_model(copy.deepcopy(base), attn="entmax_bisect",
                              attn_options={"alpha": callback.alpha, "chunk_size": 8})
        assert torch.equal(logits(model), logits(ramp))  # alpha-entmax at alpha(t), exactly
    callback.on_step_begin(None, state(5, 10), None, model=model)
    assert callback.alpha == alpha and model.config._attn_implementation == target
    assert all(vars(m)[OPTIONS_ATTR] is o for m, o in zip(attention_modules(model), own))
    plain = hs.patch_model(copy.deepcopy(base), attn=target, attn_options={"chunk_size": 8})
    assert torch.equal(logits(model), logits(plain))  # bit for bit: the target's own closed form
    assert model.config.hf_sparsemax == plain.config.hf_sparsemax


def test_fitted_temperatures_ramp_from_1_and_are_given_back_exactly():
    base = tiny_llama()
    fitted = [[0.5, 0.25, 2.0, 1.0], [0.3, 0.7, 1.0, 4.0]]
    model = hs.patch_model(copy.deepcopy(base), attn="entmax15", attn_options={"temperature": fitted})
    callback = hs.AlphaScheduleCallback(share=0.5, start=1.01)  # 4 steps: steps 0, 1 on the ramp
    callback.on_train_begin(None, state(0, 4), None, model=model)
    plain = hs.patch_model(copy.deepcopy(base), attn="entmax_bisect", attn_options={"alpha": 1.01})
    assert torch.equal(logits(model), logits(plain))  # temperature 1 at the start: alpha-entmax of the raw scores
    callback.on_step_begin(None, state(1, 4), None, model=model)  # half way: T ** 0.5
    half = [[t ** 0.5 for t in layer] for layer in fitted]
    ramp = hs.patch_model(copy.deepcopy(base), attn="entmax_bisect", attn_options={"alpha": 1.255, "temperature": half})
    assert torch.equal(logits(model), logits(ramp))
    callback.on_step_begin(None, state(2, 4), None, model=model)
    target = hs.patch_model(copy.deepcopy(base), attn="entmax15", attn_options={"temperature": fitted})
    assert torch.equal(logits(model), logits(target)) and model.config.hf_sparsemax == target.config.hf_sparsemax


def test_scheduled_alpha_is_linear_and_reaches_the_target():
    values = [scheduled_alpha(t, 1.01, 1.5, 4) for t in range(6)]
    assert values[0] == 1.01 and values[4] == values[5] == 1.5
    assert all(b - a == pytest.approx(0.1225) for a, b in zip(values[:4], values[1:5]))


def test_bad_schedules_are_refused():
    for kwargs in ({"share": 0}, {"share": 1.5}, {"start": 1.0}, {"start": 2}, {"share": True}):
        with pytest.raises(ValueError):
            hs.AlphaScheduleCallback(**kwargs)
    with pytest.raises(ValueError, match="sparse attention"):
        drive(hs.AlphaScheduleCallback(), tiny_llama(), 10, 1)
    with pytest.raises(ValueError, match="no alpha"):
        drive(hs.AlphaScheduleCallback(), hs.patch_model(tiny_llama(), attn="sparse_softmax"), 10, 1)
    with pytest.raises(ValueError, match="must rise"):
        drive(hs.AlphaScheduleCallback(start=1.4), hs.patch_model(
            tiny_llama(), attn="entmax_bisect", attn_options={"alpha": 1.3}), 10, 1)


class Recorder(TrainerCallback):
    """Per step (after the schedule's on_step_begin): the attention implementation, its alpha, the learned alphas."""

    def __init__(self):
        self.steps = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        options = vars(attention_modules(model)[0])[OPTIONS_ATTR]
        alphas = [1 + torch.sigmoid(m.pre_alpha.detach().clone()) for m in model.modules()
                  if isinstance(m, LearnedAlpha)]
        self.steps.append((model.config._attn_implementation, options.alpha, alphas))


def train(model, callbacks, tmp_path, learning_rate, steps=4):
    data = Dataset.from_list([{**{k: v[0] for k, v in batch(seed=s, size=1).items()},
                               "labels": batch(seed=s, size=1)["input_ids"][0]} for s in range(8)])
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
                             learning_rate=learning_rate, optim="sgd", lr_scheduler_type="constant", report_to="none",
                             use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    return model.eval()


def test_through_trainer_the_schedule_ends_bit_for_bit_on_entmax15(tmp_path):
    base = tiny_llama()
    model, recorder = hs.patch_model(copy.deepcopy(base), attn="entmax15"), Recorder()
    train(model, [hs.AlphaScheduleCallback(share=0.5), recorder], tmp_path, learning_rate=0.0)
    assert [(name, round(a, 6)) for name, a, _ in recorder.steps] == [
        ("entmax_bisect", 1.01), ("entmax_bisect", 1.255), ("entmax15", 1.5), ("entmax15", 1.5)]
    assert torch.equal(logits(model), logits(hs.patch_model(copy.deepcopy(base), attn="entmax15")))


def test_with_a_learned_alpha_the_schedule_sets_its_start_then_releases_it(tmp_path):
    model, recorder = tiny_llama(), Recorder()
    hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": 1.5, "learn_alpha": True})
    train(model, [hs.AlphaScheduleCallback(share=0.5, start=1.01), recorder], tmp_path, learning_rate=5.0, steps=5)
    fresh = LearnedAlpha(HEADS, 1.5)().flatten()
    ramp = [1.01, 1.01 + 0.49 / 3, 1.01 + 2 * 0.49 / 3]  # T = round(0.5 * 5) = 3 steps on the ramp
    for step, alpha in enumerate(ramp):  # every head at alpha(t), untouched by the optimizer while frozen
        assert all(torch.allclose(a, torch.full_like(a, alpha), atol=1e-6) for a in recorder.steps[step][2])
    assert all(torch.equal(a, fresh) for a in recorder.steps[3][2])  # released exactly at LearnedAlpha's start
    trained = [1 + torch.sigmoid(m.pre_alpha.detach()) for m in model.modules() if isinstance(m, LearnedAlpha)]
    assert all(m.pre_alpha.requires_grad for m in model.modules() if isinstance(m, LearnedAlpha))
    spread = torch.cat(trained)
    assert spread.max() - spread.min() > 1e-4 and not torch.equal(spread, fresh.repeat(2))  # learned apart


# -- self-distillation


def peft_model(base, attn="entmax15"):
    """A LoRA model with a non-zero adapter (so "adapter off" is visible), patched with ``attn``."""
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    return hs.patch_model(get_peft_model(copy.deepcopy(base), config), attn=attn)


def attention_outputs(model, inputs):
    with torch.no_grad(), hs.SelfDistillation().student(model) as outputs:
        model(**inputs)
    return outputs


def test_the_teacher_is_softmax_with_the_adapter_off():
    base = tiny_llama()
    model, inputs = peft_model(base), batch()
    teacher = hs.SelfDistillation().teacher(model.train(), inputs)
    unpatched = attention_outputs(copy.deepcopy(base).eval(), inputs)
    assert len(teacher) == len(unpatched) == 2
    for t, u in zip(teacher, unpatched):
        torch.testing.assert_close(t, u, rtol=1e-6, atol=1e-7)
        assert not t.requires_grad and t.grad_fn is None  # no graph: nothing flows back into the teacher
    student = attention_outputs(model, inputs)  # given back: sparse attention, adapter on, training mode
    assert model.training and model.base_model.model.config._attn_implementation == "entmax15"
    assert not torch.allclose(student[0], unpatched[0], atol=1e-3)


def test_the_teacher_gives_back_what_the_schedule_froze_so_a_recomputed_backward_runs():
    """On the ramp the learned alphas are frozen at alpha 1.01 (off the threshold path: query blocks recomputed in
    the backward); peft's adapter switch in the teacher's pass sets its trainable copies' requires_grad on the way
    out. Given back frozen, the backward recomputes the blocks as the forward ran them and the alphas get no
    gradient (before: torch.utils.checkpoint's CheckpointError, "Recomputed values ... different metadata")."""
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    model = hs.patch_model(get_peft_model(tiny_llama(), config), attn="entmax_bisect",
                           attn_options={"alpha": 1.5, "learn_alpha": True, "chunk_size": 4}).train()
    learned = [m for m in model.modules() if isinstance(m, LearnedAlpha)]
    assert any(m.pre_alpha.requires_grad for m in learned)  # peft's trainable copies
    callback = hs.AlphaScheduleCallback(share=0.5, start=1.01)
    callback.on_train_begin(None, state(0, 10), None, model=model)  # step 0: every alpha frozen at 1.01
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    assert not any(m.pre_alpha.requires_grad for m in learned)
    distill, inputs = hs.SelfDistillation(), batch()
    with distill.student(model) as outputs:
        loss = model(**inputs, labels=inputs["input_ids"]).loss
    term = distill.term(model, inputs, outputs)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    (loss + term).backward()
    assert all(m.pre_alpha.grad is None for m in learned)
    assert all(p.grad is not None for name, p in model.named_parameters() if "lora_" in name)


def test_the_term_is_the_relative_error_and_its_gradient_treats_the_teacher_as_constant():
    model, inputs = peft_model(tiny_llama()), batch()
    distill = hs.SelfDistillation(weight=2.0)
    with distill.student(model) as student:
        model(**inputs)
    term = distill.term(model, inputs, student)
    teacher = distill.teacher(model, inputs)
    expected = 2.0 * sum(((s.double() - t.double()) ** 2).sum() / (t.double() ** 2).sum()
                         for s, t in zip(student, teacher)) / len(student)
    assert term.item() == pytest.approx(expected.item(), rel=1e-5) and distill.last == pytest.approx(term.item())
    lora = [p for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(term, lora, retain_graph=True)
    constant = 2.0 * sum(((s - t.clone()) ** 2).sum() / (t.clone() ** 2).sum() for s, t in zip(student, teacher)) / 2
    for got, want in zip(grads, torch.autograd.grad(constant, lora)):
        # float32 sums in another order (the term sums each row first): against the same gradients in float64 both
        # are within 1.4e-6 of each tensor's largest entry, but an entry 600 times smaller than that (0.297 beside
        # 176) may be off by 1.2e-4 of itself (there the term's gradient is the closer one, 7e-7 from float64's).
        # A teacher left in the graph would add its own gradient, of the order of the largest entry
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_distillation_loss_falls_on_a_tiny_model():
    model = peft_model(tiny_llama()).train()
    distill = hs.SelfDistillation()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    values = []
    for _ in range(8):
        inputs = batch(seed=5)
        with distill.student(model) as outputs:
            model(**inputs)
        term = distill.term(model, inputs, outputs)
        optimizer.zero_grad()
        term.backward()
        optimizer.step()
        values.append(term.item())
    assert values[-1] < 0.7 * values[0] and all(math.isfinite(v) for v in values)


def test_the_distillation_trainer_adds_the_term_for_its_share_of_the_steps(tmp_path):
    model = peft_model(tiny_llama())
    distill = hs.SelfDistillation(share=0.5)
    data = Dataset.from_list([{"input_ids": batch(seed=s, size=1)["input_ids"][0],
                               "labels": batch(seed=s, size=1)["input_ids"][0]} for s in range(8)])
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2,
                             report_to="none", use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = hs.distillation_trainer(Trainer, distill)(model=model, args=args, train_dataset=data)
    trainer.train()
    logged = [e.get("distill") for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 4 and all(v > 0 for v in logged[:2]) and logged[2:] == [None, None]
    assert type(trainer).__name__ == "DistillationTrainer"


def test_distillation_needs_a_peft_model_with_sparse_attention():
    inputs = batch()
    with pytest.raises(ValueError, match="peft"):
        hs.SelfDistillation().teacher(hs.patch_model(tiny_llama(), attn="entmax15"), inputs)
    with pytest.raises(ValueError, match="sparse attention"):
        hs.SelfDistillation().teacher(peft_model(tiny_llama(), attn="softmax"), inputs)
    for kwargs in ({"weight": 0}, {"share": 0}, {"share": 2}):
        with pytest.raises(ValueError):
            hs.SelfDistillation(**kwargs)


# -- resuming and accumulating: what a checkpoint restored is kept, the step's objective is the same


class StopAt(TrainerCallback):
    """Ends training after step ``step`` with a checkpoint, as an interrupted run leaves it."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = control.should_training_stop = True


def resumable(tmp_path, stop_at=None, resume_at=None, max_steps=8):
    """A tiny Llama with learned alphas and learned temperatures trained by Trainer with the schedule for
    ``max_steps`` (SGD), interrupted after step ``stop_at`` (a checkpoint) or resumed from its checkpoint
    ``resume_at``; its parameters at the end."""
    model = hs.patch_model(tiny_llama(), attn="entmax_bisect", attn_options={
        "alpha": 1.5, "learn_alpha": True, "learn_temperature": True,
        "temperature": [[0.5, 0.8, 1.25, 2.0], [1.5, 0.7, 1.1, 0.9]]})
    data = Dataset.from_list([{**{k: v[0] for k, v in batch(seed=s, size=1).items()},
                               "labels": batch(seed=s, size=1)["input_ids"][0]} for s in range(8)])
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=2,
                             learning_rate=5.0, optim="sgd", lr_scheduler_type="constant", report_to="none",
                             use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    callbacks = [hs.AlphaScheduleCallback(share=0.5, start=1.01)] + ([StopAt(stop_at)] if stop_at else [])
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=None if resume_at is None else str(tmp_path / f"checkpoint-{resume_at}"))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.slow
def test_a_run_resumed_before_inside_or_after_the_ramp_equals_the_uninterrupted_run(tmp_path):
    """8 steps, the ramp on steps 0-3 (share 0.5): resumed at step 2 (inside the ramp), 4 (the step that ends
    it) and 6 (after it, the learned alphas and temperatures trained apart) the parameters after 8 steps are the
    uninterrupted run's. Before the fix a resume past the ramp reset every learned alpha to its start."""
    whole = resumable(tmp_path / "whole")
    learned = torch.cat([p for name, p in whole.items() if name.endswith("pre_alpha")])
    assert learned.abs().min() > 1e-4  # every head moved from its start (pre_alpha 0): a reset would show
    for step in (2, 4, 6):
        folder = tmp_path / f"resumed-{step}"
        resumable(folder, stop_at=step)  # the first part of the run, ending in checkpoint-<step>
        resumed = resumable(folder, resume_at=step)
        for name, value in whole.items():
            torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=f"{name}, resumed at {step}")


def test_the_ramp_leaves_the_fitted_temperatures_in_place():
    """On the ramp the temperatures used are ``T ** f``, while the values and the learned parameter (what a
    checkpoint saves) stay the fitted ones."""
    fitted = [[0.5, 0.8, 1.25, 2.0], [1.5, 0.7, 1.1, 0.9]]
    model = hs.patch_model(tiny_llama(), attn="entmax15", attn_options={
        "temperature": fitted, "learn_temperature": True})
    heats = [m for m in model.modules() if isinstance(m, hs.HeadTemperature)]
    callback = hs.AlphaScheduleCallback(share=0.5, start=1.01)
    drive(callback, model, 10, 3)  # step 2 of a 5-step ramp: f = 2 / 5
    for heat, values in zip(heats, fitted):
        torch.testing.assert_close(heat.log_temperature.detach().exp(), torch.tensor(values))
        torch.testing.assert_close(heat(), torch.tensor(values) ** 0.4)
        assert not heat.log_temperature.requires_grad
    callback.on_train_end(None, state(3, 10), None, model=model)
    assert all(torch.allclose(h(), torch.tensor(v)) and h.log_temperature.requires_grad for h, v in zip(heats, fitted))


def distilled_step(tmp_path, batch_size, accumulation):
    """One optimizer step of the distillation trainer (weight 1000) on 8 copies of one sequence: the logged loss
    and the adapter's weights after it."""
    model = peft_model(tiny_llama())
    row = batch(seed=4, size=1)["input_ids"][0]
    data = Dataset.from_list([{"input_ids": row, "labels": row}] * 8)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=accumulation, learning_rate=1e-2, optim="sgd",
                             report_to="none", use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = hs.distillation_trainer(Trainer, hs.SelfDistillation(weight=1000.0))(
        model=model, args=args, train_dataset=data)
    trainer.train()
    (logged,) = [e for e in trainer.state.log_history if "loss" in e]
    return float(logged["loss"]), {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_under_gradient_accumulation_an_optimizer_step_distills_once(tmp_path):
    """1 batch of 8 and 4 accumulated batches of 2 of the same rows: one step's loss and update are the same.
    Before, the term was added in full to each micro-batch's loss, which Trainer does not divide when
    ``num_items_in_batch`` normalises the cross-entropy: 4 x 2 counted it 4 times."""
    whole_loss, whole = distilled_step(tmp_path / "whole", 8, 1)
    parts_loss, parts = distilled_step(tmp_path / "parts", 2, 4)
    assert whole_loss > 10  # the term (weight 1000) dominates the cross-entropy: counting it 4 times would show
    assert parts_loss == pytest.approx(whole_loss, rel=1e-4)
    for name, value in whole.items():
        torch.testing.assert_close(parts[name], value, rtol=1e-4, atol=1e-7, msg=name)
