"""fuse() on Hugging Face causal LMs (small configs, no download): in training with labels the LM
head and the loss run as one linear_cross_entropy with the model's loss and gradients (float32,
1e-5), no logits returned; eval(), no labels and no grad mode run the model as before; tied
embeddings, Gemma 2's final logit softcapping, num_items_in_batch and shift_labels; a model whose
logits are post-processed otherwise is left and reported; compiled, it keeps the eager loss with
ignored labels, in one graph."""

import copy

import pytest
import torch
import transformers

from _helpers import rel_err
from fusedlayers.torch import fuse

transformers.logging.set_verbosity_error()

VOCAB = 96
MODELS = {"llama": ("Llama", {}), "qwen3": ("Qwen3", {}),
          "qwen2-tied": ("Qwen2", dict(tie_word_embeddings=True)),
          "gemma2-softcap": ("Gemma2", dict(final_logit_softcapping=3.0))}


def causal_lm(name: str, **extra):
    cls, options = MODELS.get(name, (name, {}))
    config = getattr(transformers, f"{cls}Config")(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64, head_dim=16,
        pad_token_id=0, **options, **extra)
    return getattr(transformers, f"{cls}ForCausalLM")(config)


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 11), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt's tokens, ignored
    return ids, labels


def loss_and_grads(model, **inputs):
    out = model(**inputs)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, [p for _, p in model.named_parameters()
                                           if p.requires_grad], allow_unused=True)
    return out, dict(zip(names, grads))


@pytest.mark.parametrize("name", MODELS)
def test_training_loss_and_grads_unchanged_no_logits(name, seed):
    model = causal_lm(name)
    original = copy.deepcopy(model)
    params, state = [(n, id(p)) for n, p in model.named_parameters()], model.state_dict().keys()
    fuse(model)
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert model.state_dict().keys() == state
    report = model.fusedlayers_report
    assert any(path == "lm_head" and "linear_cross_entropy" in what
               for path, _, what in report.swapped), report
    if name == "qwen2-tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, labels = batch(seed)
    model.train()
    original.train()
    # dropout is 0 in these configs: both models compute the same function
    out, grads = loss_and_grads(model, input_ids=ids, labels=labels)
    ref, grads_ref = loss_and_grads(original, input_ids=ids, labels=labels)
    assert out.logits is None and ref.logits is not None
    assert out.loss.dtype == ref.loss.dtype == torch.float32
    assert rel_err(out.loss, ref.loss) <= 1e-5
    total = torch.cat([g.flatten() for g in grads_ref.values() if g is not None]).norm().item()
    for k, g in grads.items():
        assert (g is None) == (grads_ref[k] is None), k
        if g is not None:
            assert (g - grads_ref[k]).norm().item() <= 1e-5 * max(grads_ref[k].norm().item(),
                                                                 1e-3 * total), k


@pytest.mark.parametrize("name", ["llama", "gemma2-softcap"])
def test_eval_no_labels_and_no_grad_run_as_before(name, seed):
    model = causal_lm(name)
    original = copy.deepcopy(model)
    fuse(model)
    ids, labels = batch(seed)
    for train, grad, with_labels in ((False, True, True), (True, True, False),
                                     (True, False, True)):
        model.train(train)
        original.train(train)
        kwargs = dict(input_ids=ids, labels=labels if with_labels else None)
        with torch.set_grad_enabled(grad):
            out, ref = model(**kwargs), original(**kwargs)
        # the model's own head and loss (its other layers fused: float32 rounding apart)
        assert out.logits is not None and rel_err(out.logits, ref.logits) <= 1e-5
        assert out.logits.grad_fn is None or out.logits.grad_fn.name() == \
            ref.logits.grad_fn.name()
        assert (out.loss is None) == (ref.loss is None)
        if out.loss is not None:
            assert rel_err(out.loss, ref.loss) <= 1e-5


def test_num_items_in_batch_and_shift_labels(seed):
    model = causal_lm("llama")
    original = copy.deepcopy(model)
    fuse(model)
    ids, labels = batch(seed)
    items = torch.tensor(57)  # a whole accumulated batch's count: the loss divides by it
    for kwargs in (dict(labels=labels, num_items_in_batch=items),
                   dict(labels=labels, shift_labels=labels.roll(-2, dims=1))):
        out = model(input_ids=ids, **kwargs)
        ref = original(input_ids=ids, **kwargs)
        assert out.logits is None and rel_err(out.loss, ref.loss) <= 1e-5, kwargs


def test_logits_post_processed_otherwise_is_left():
    model = causal_lm("Granite", logits_scaling=2.0)  # divides the logits before the loss
    fuse(model)
    [(path, _, why)] = [e for e in model.fusedlayers_report.left if e[0] == "lm_head"]
    assert "differs from the fused one on a probe" in why
    assert "forward" not in vars(model) and "forward" not in vars(model.lm_head)
    ids, labels = batch(0)
    assert model(input_ids=ids, labels=labels).logits is not None


def test_compiled_keeps_the_eager_loss_with_ignored_labels_without_graph_breaks(seed):
    model = causal_lm("llama").train()
    fuse(model)
    ids, labels = batch(seed)
    labels[1, 5:] = -100
    eager = model(input_ids=ids, labels=labels).loss
    compiled = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=labels).loss
    assert rel_err(compiled, eager) <= 1e-6
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=labels)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_switched_off_and_not_fused_twice():
    model = causal_lm("llama")
    fuse(model, linear_cross_entropy=False)
    assert not any("linear_cross_entropy" in what for _, _, what in
                   model.fusedlayers_report.swapped)
    fuse(model)
    fuse(model)
    [(_, _, why)] = [e for e in model.fusedlayers_report.left if e[0] == "lm_head"]
    assert "already an instance's own" in why


def test_under_autocast_and_in_bfloat16(seed):
    ids, labels = batch(seed)
    for dtype, autocast in ((torch.float32, True), (torch.bfloat16, False)):
        model = causal_lm("llama").to(dtype).train()
        original = copy.deepcopy(model)
        fuse(model)
        assert any("linear_cross_entropy" in what for _, _, what in
                   model.fusedlayers_report.swapped)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=labels)
            ref = original(input_ids=ids, labels=labels)
        assert out.logits is None and rel_err(out.loss, ref.loss) <= 2e-2
        out.loss.backward()
        assert all(p.grad is not None and p.grad.dtype == dtype for p in model.parameters())


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("precision", ["bfloat16", "float16", "autocast"])
def test_logged_loss_is_the_unfused_float32_loss(name, precision):
    # Hugging Face upcasts the logits and returns a float32 loss; so does the fused model, from
    # its float32 row losses (a loss rounded to bfloat16 is up to 2^-9 off: stairs in a curve)
    dtype = torch.float32 if precision == "autocast" else getattr(torch, precision)
    model = causal_lm(name).to(dtype).train()
    original = copy.deepcopy(model)
    fuse(model)
    for seed in range(3):
        ids, labels = batch(seed)
        for extra in ({}, dict(num_items_in_batch=torch.tensor(40))):
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "autocast"):
                got = model(input_ids=ids, labels=labels, **extra).loss
                want = original(input_ids=ids, labels=labels, **extra).loss
            assert got.dtype == want.dtype == torch.float32
            assert rel_err(got, want) <= 2e-4, (seed, extra, float(got), float(want))
