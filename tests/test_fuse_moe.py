"""fuse() on transformers' mixture-of-experts causal LMs (small configs of Qwen3-MoE, Mixtral,
OLMoE, gpt-oss, DeepSeek-V3 and Granite-MoE, no download): the experts become moe_experts and the
LM head with its loss one linear_cross_entropy, and the loss training backpropagates is the
model's own, the router's load-balancing term included (output_router_logits from the config or
from the call): the loss and every parameter's gradient, the routers' included, against the
unfused model in float32 (1e-5) and in bfloat16 (calibrated against float32), and a few AdamW
steps tracking the unfused model's."""

import copy

import pytest
import torch

from _helpers import rel_err
from fusedlayers.torch import fuse

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "granitemoe"]
VOCAB = 101


def moe_lm(name, output_router_logits=False, every_expert=False):
    """A small model of the family; every_expert: each token's top-k is all its experts (no
    discrete routing: two bfloat16 models cannot send a near-tie token to different experts)."""
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0,
                  output_router_logits=output_router_logits,
                  # a load-balancing term far above the loss's float32 rounding
                  router_aux_loss_coef=0.05)
    configs = {
        "qwen3_moe": dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
                          head_dim=8, decoder_sparse_step=1, mlp_only_layers=[]),
        "mixtral": dict(intermediate_size=24, num_local_experts=5, num_experts_per_tok=2),
        "olmoe": dict(intermediate_size=24, num_experts=6, num_experts_per_tok=3),
        "gpt_oss": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                        head_dim=8, layer_types=["sliding_attention", "full_attention"]),
        "deepseek_v3": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                            num_experts_per_tok=2, n_group=2, topk_group=1,
                            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                            num_key_value_heads=4),
        "granitemoe": dict(intermediate_size=24, num_local_experts=5, num_experts_per_tok=2),
    }
    options = {**common, **configs[name]}
    if every_expert:
        count = next(options[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                     if k in options)
        options.update(num_experts_per_tok=count)
        if name == "deepseek_v3":
            options.update(n_group=1, topk_group=1)
    config = transformers.CONFIG_MAPPING[name](**options)
    return transformers.AutoModelForCausalLM.from_config(config).float().train()


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 11), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt's tokens, ignored
    return ids, labels


def run(model, kwargs):
    """(output, {name: gradient}) of one forward and backward of the output's loss; the
    unfused model itself failing is a skip (transformers' bug), not ours."""
    try:
        out = model(**kwargs)
    except Exception as e:
        if "forward" in vars(model):
            raise
        pytest.skip(f"the unfused model fails on its own: {type(e).__name__}: {e}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, [p for _, p in named], allow_unused=True)
    return out, {n: g for (n, _), g in zip(named, grads)}


def name_of(model):
    return model.config.model_type


def fused_copy(model):
    fused = fuse(copy.deepcopy(model))
    report = fused.fusedlayers_report
    experts = [p for p, m in fused.named_modules() if hasattr(m, "is_transposed")]
    swapped = {p: what for p, _, what in report.swapped}
    assert experts and set(experts) <= set(swapped), report
    assert "lm_head" in swapped, report
    if name_of(model) != "deepseek_v3":
        assert "load-balancing loss" in swapped["lm_head"] and "kept" in swapped["lm_head"]
    return fused


@pytest.mark.parametrize("router", ["config", "forward"])
@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_every_gradient_keep_the_router_loss(name, router, seed):
    torch.manual_seed(seed)
    model = moe_lm(name, output_router_logits=router == "config")
    ids, labels = batch(seed)
    kwargs = dict(input_ids=ids, labels=labels)
    if router == "forward":
        kwargs["output_router_logits"] = True
    ref, grads_ref = run(model, kwargs)  # first: where it fails on its own, a skip
    fused = fused_copy(model)
    out, grads = run(fused, kwargs)
    assert out.logits is None and ref.logits is not None
    if name != "deepseek_v3":  # DeepSeek-V3 has no load-balancing term in its loss
        assert ref.aux_loss is not None and out.aux_loss is not None
        assert rel_err(out.aux_loss, ref.aux_loss) <= 1e-6
        # the term is in the loss the test compares: without it the losses would differ
        coef = model.config.router_aux_loss_coef
        assert abs(coef * ref.aux_loss.item()) > 100 * 1e-5 * abs(ref.loss.item())
    assert rel_err(out.loss, ref.loss) <= 1e-5
    assert grads.keys() == grads_ref.keys()
    routers = [n for n in grads if ".gate." in n or n.endswith("router.weight")]
    assert routers, sorted(grads)
    for n, g in grads.items():
        if grads_ref[n] is None:
            assert g is None, n
        else:
            assert rel_err(g, grads_ref[n]) <= 1e-5, n


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_loss_and_gradients_calibrated(name, seed):
    """In bfloat16 the fused model is as close to the float32 model as the unfused one is (both
    round their GEMMs and activations to bfloat16, in other orders): the loss and every
    parameter's gradient. Every token takes every expert here: with a top-k, a token near a tie
    may take another expert in either bfloat16 model, which moves its share of two experts'
    gradients."""
    torch.manual_seed(seed)
    model = moe_lm(name, output_router_logits=True, every_expert=True)
    ids, labels = batch(seed)
    kwargs = dict(input_ids=ids, labels=labels)
    truth, grads_truth = run(model, kwargs)
    half = copy.deepcopy(model).bfloat16()
    fused = fused_copy(half)
    ref, grads_ref = run(half, kwargs)
    out, grads = run(fused, kwargs)
    assert out.loss.dtype == ref.loss.dtype
    assert rel_err(out.loss, truth.loss) <= 2 * rel_err(ref.loss, truth.loss) + 2e-3
    for n, g in grads.items():
        if grads_truth[n] is not None:
            base = rel_err(grads_ref[n].float(), grads_truth[n])
            assert rel_err(g.float(), grads_truth[n]) <= 2 * base + 2e-2, n


def test_adamw_steps_track_the_unfused_model(seed):
    """Trained five AdamW steps with the router loss on, the fused model's losses stay with the
    unfused model's, and its weights are as close to the same training in float64 as the
    unfused float32 model's are (AdamW's normalized steps make the float32 runs' rounding
    differences grow unevenly: seeds where the unfused model is 5e-4 from float64 and the fused
    one closer exist), within a floor of a few times the two float32 runs' usual distance."""
    torch.manual_seed(seed)
    model = moe_lm("qwen3_moe", output_router_logits=True)
    fused = fused_copy(model)
    exact = copy.deepcopy(model).double()
    exact.set_experts_implementation("eager")  # torch's grouped_mm takes no float64
    models = (model, fused, exact)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(5):
        ids, labels = batch(seed + step)
        losses = []
        for m, opt in zip(models, opts):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[1] - losses[0]) <= 1e-4 * abs(losses[0]), (step, losses)
    for (n, p), q, r in zip(model.named_parameters(), fused.parameters(), exact.parameters()):
        ours, unfused = (rel_err(t.detach().double(), r.detach()) for t in (q, p))
        assert ours <= 2 * unfused + 5e-5, (n, ours, unfused)


def test_fused_experts_undone():
    fused = fuse(moe_lm("qwen3_moe"))
    experts = [m for m in fused.modules() if hasattr(m, "is_transposed")]
    del experts[0].forward  # the class's forward again
    assert "forward" not in vars(experts[0])
    del fused.forward, fused.lm_head.forward, fused._loss_function
    ids, labels = batch(0)
    assert fused(input_ids=ids, labels=labels).logits is not None


def test_fuse_leaves_what_it_cannot_take():
    model = moe_lm("qwen3_moe")
    model.model.layers[0].mlp.experts._is_expert_parallel = True
    report = fuse(model, moe_experts=True).fusedlayers_report
    assert any("expert-parallel" in why for path, _, why in report.left
               if path == "model.layers.0.mlp.experts"), report
    untouched = fuse(moe_lm("qwen3_moe"), moe_experts=False)
    assert not any("forward" in m.__dict__ for m in untouched.modules()
                   if hasattr(m, "is_transposed"))


def test_num_items_in_batch_shift_labels_and_tuples(seed):
    torch.manual_seed(seed)
    model = moe_lm("mixtral", output_router_logits=True)
    fused = fused_copy(model)
    ids, labels = batch(seed)
    for kwargs in (dict(num_items_in_batch=torch.tensor(37)),
                   dict(shift_labels=labels.roll(-2, dims=1)), dict(return_dict=False)):
        ref = model(input_ids=ids, labels=labels, **kwargs)
        out = fused(input_ids=ids, labels=labels, **kwargs)
        if isinstance(ref, tuple):  # (loss, aux_loss, logits, ...); fused: no logits
            assert isinstance(out, tuple) and len(out) == len(ref) - 1
            assert rel_err(out[1], ref[1]) <= 1e-6
            ref, out = ref[0], out[0]
        else:
            assert out.logits is None
            ref, out = ref.loss, out.loss
        assert rel_err(out, ref) <= 1e-5, kwargs
