"""`python -m fusedlayers bench --model NAME`: whole-model training steps, unfused against the same
model after `fusedlayers.torch.fuse`, eager and under torch.compile, with autocast (bfloat16
compute, float32 parameters), with bfloat16 parameters or in float32, at a host-bound and a
GPU-bound batch.

Models are Hugging Face's, built from their default (base) configs with random weights, no
download: bert-base (BertModel), vit-base (ViTModel, 224x224 images), gpt2 (GPT2Model, 124M),
llama (a ~1.1B LlamaModel, 4 x 2048 tokens), llama-lm / llama-lm-128k (the same as
LlamaForCausalLM with vocabularies of 32000 / 128256, trained on its own loss of the input ids as
labels: fuse() runs its head and loss as linear_cross_entropy) and qwen3-moe (a
Qwen3-30B-A3B-shaped Qwen3MoeForCausalLM of 8 layers: hidden 2048, 32/4 heads of 128, 128 experts
of width 768, top-8, vocabulary 151936, 2 x 2048 tokens, bf16 parameters by default; fuse() runs
its experts as moe_experts) and llama-8b-layers (Llama-3-8B's layer shape: hidden 4096, ffn
14336, 32/8 heads of 128, vocabulary 128256, LAYERS_8B of its 32 layers, 1 x 4096 tokens, bf16
parameters with float32 masters by default); `tiny` shrinks each to 2 layers of width 64 for a
quick run on the CPU. A step is forward, a loss (the causal LMs' own; else the
mean square of the last hidden state), backward and AdamW (fused on CUDA).

Unfused and fused run interleaved in A/B rounds (ABBA order), so drift in clocks or host load hits
both alike; each step's wall time is taken between device synchronizations, and the median over
all rounds is reported. GPU-busy time is the sum of kernel times per step from torch.profiler;
"ours" is the part spent in fusedlayers' own kernels (the cuBLASLt GEMMs of linear_gelu are
counted with the other GEMMs). Peak memory is torch.cuda.max_memory_allocated over one step.
The first forward of the fused model, in eval() on the same input, is compared with the unfused
one: ||fused - unfused|| / ||unfused||.

With `fp8` the fused model is also timed as `fuse(model, fp8=recipe)` (blockwise and
tensorwise: its linears FP8, the gated MLPs as fp8_gated_mlp, the LM head in bf16; blockwise
also keeping the forward's FP8 W^T for the backward, recompute_fp8_weights=False) and, with
`peers` where torchao imports, as torchao's float8 training (tensorwise and rowwise, the LM head
left out as fuse() leaves it) under torch.compile, which torchao's casts need; their rows follow
the case's row.

With `distributed` (under torchrun, `bench --model NAME --distributed`) both models train under
DistributedDataParallel over NCCL, one process per GPU, each on `batch` samples (the global batch
is batch x processes); the first process reports its times. Wall times include the gradient
all-reduce; GPU-busy time leaves NCCL's kernels out, as they spend most of their time waiting for
the other process while the compute runs beside them.
"""

import copy
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .table import did_not_run, out_of_memory

MODELS = ("bert-base", "vit-base", "gpt2", "llama", "llama-lm", "llama-lm-128k", "qwen3-moe",
          "llama-8b-layers")
# (host-bound, GPU-bound) batch on an H100, and on the CPU (tiny configs); llama: 4 x 2048 tokens.
DEFAULT_BATCHES = {"bert-base": (16, 64), "vit-base": (32, 128), "gpt2": (16, 64), "llama": (4,),
                   "llama-lm": (4,), "llama-lm-128k": (4,), "qwen3-moe": (2,),
                   "llama-8b-layers": (1,)}
# llama-8b-layers' decoder layers: its ~2.8B parameters (with the embedding and head) in bf16
# with gradients, float32 masters and AdamW's moments (16 bytes a parameter, ~45 GB, one copy
# shared by the variants) beside one variant's activations of 4096 tokens fit an 80 GB GPU.
LAYERS_8B = 8
# Models whose variants share one set of parameters and one optimizer (each variant is the same
# weights under a different forward): three copies of the MoE's ~5.5B parameters with their
# gradients and AdamW states would not fit one GPU, nor would the 8B layers' copies with the
# FP8 variants.
SHARED_WEIGHTS = {"qwen3-moe", "llama-8b-layers"}
# Precisions when none is asked for: the MoE in bf16 parameters.
DEFAULT_PRECISIONS = {"qwen3-moe": ("bf16",), "llama-8b-layers": ("bf16-master",)}
# Layers with float32 parameters (autocast, fp32) where the model's own count would not fit an
# 80 GB GPU: the MoE's float32 parameters, gradients and AdamW states of 8 layers take ~88 GB.
FLOAT32_LAYERS = {"qwen3-moe": 4}
CPU_BATCHES = (8,)
SEQ = 512


@dataclass
class ModelRow:
    model: str
    batch: int
    # "autocast" (bf16 compute, fp32 params), "bf16" (bf16 params), "bf16-master" (bf16 params,
    # float32 master weights and moments in fusedlayers' AdamW) or "fp32"
    precision: str
    mode: str  # "eager" or "compile"
    unfused_ms: float | None  # None where it did not run (not_run says why)
    fused_ms: float | None
    speedup: float | None  # unfused_ms / fused_ms
    unfused_gpu_ms: float | None
    fused_gpu_ms: float | None
    fused_ours_gpu_ms: float | None
    unfused_peak_mb: float | None
    fused_peak_mb: float | None
    first_forward_rel_diff: float
    # With peers on the Llamas and the MoE: Liger-Kernel's patches on the same model (eager)
    liger_ms: float | None = None
    liger_peak_mb: float | None = None
    not_run: str = ""  # which variants did not run, and why
    # With fp8: each FP8 variant's {"ms", "gpu_ms", "peak_mb", "vs_fused"} (fused_ms / its ms;
    # gpu_ms: its kernels' GPU time a step, None off CUDA)
    fp8: dict = field(default_factory=dict)


def build(name: str, tiny: bool, seed: int = 0, layers: int | None = None):
    """(model, inputs(batch, device, dtype)) for one of MODELS, from config, random weights;
    layers: the decoder's layer count instead of the model's (Llamas and the MoE)."""
    import transformers
    transformers.logging.set_verbosity_error()
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 intermediate_size=256) if tiny else {}
    seq = 32 if tiny else SEQ
    torch.manual_seed(seed)
    if name == "bert-base":
        # No pooler: the loss never reads it, and DDP requires every parameter to get a grad.
        model = transformers.BertModel(transformers.BertConfig(**small), add_pooling_layer=False)
        vocab = model.config.vocab_size

        def inputs(batch, device, dtype):
            return {"input_ids": torch.randint(0, vocab, (batch, seq), device=device)}
    elif name == "gpt2":
        gpt_small = dict(n_layer=2, n_embd=64, n_head=4, n_inner=256) if tiny else {}
        model = transformers.GPT2Model(transformers.GPT2Config(**gpt_small))
        vocab = model.config.vocab_size

        def inputs(batch, device, dtype):
            return {"input_ids": torch.randint(0, vocab, (batch, seq), device=device)}
    elif name == "llama-8b-layers":
        llama8 = dict(hidden_size=4096, num_hidden_layers=layers or LAYERS_8B,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      intermediate_size=14336, vocab_size=128256, max_position_embeddings=4096,
                      rope_theta=500000.0)
        if tiny:
            llama8.update(small, num_key_value_heads=2, head_dim=16, vocab_size=1000)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama8))
        vocab, llama8_seq = model.config.vocab_size, 32 if tiny else 4096

        def inputs(batch, device, dtype):
            ids = torch.randint(0, vocab, (batch, llama8_seq), device=device)
            return {"input_ids": ids, "labels": ids}
    elif name.startswith("llama"):
        # A ~1.1B Llama (d 2048, 16 layers, GQA 32/8 heads, ffn 5632, vocab 32000), 2048 tokens;
        # -lm: LlamaForCausalLM with its own loss on labels (fuse() fuses the head and loss),
        # -128k: Llama 3's vocabulary of 128256
        llama = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=5632, vocab_size=32000,
                     max_position_embeddings=2048)
        if name.endswith("128k"):
            llama.update(vocab_size=128256)
        if tiny:
            llama.update(small, num_key_value_heads=2, vocab_size=1000)
        if layers:
            llama.update(num_hidden_layers=layers)
        lm = name.startswith("llama-lm")
        model_cls = transformers.LlamaForCausalLM if lm else transformers.LlamaModel
        model = model_cls(transformers.LlamaConfig(**llama))
        vocab, llama_seq = model.config.vocab_size, 32 if tiny else 2048

        def inputs(batch, device, dtype):
            ids = torch.randint(0, vocab, (batch, llama_seq), device=device)
            return {"input_ids": ids, **({"labels": ids} if lm else {})}
    elif name == "qwen3-moe":
        moe = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32,
                   num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                   moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936,
                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                   max_position_embeddings=2048)
        if tiny:
            moe.update(small, num_key_value_heads=2, head_dim=16, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=1000)
        if layers:
            moe.update(num_hidden_layers=layers)
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**moe))
        vocab, moe_seq = model.config.vocab_size, 32 if tiny else 2048

        def inputs(batch, device, dtype):
            ids = torch.randint(0, vocab, (batch, moe_seq), device=device)
            return {"input_ids": ids, "labels": ids}
    elif name == "vit-base":
        vit_small = dict(small, image_size=32, patch_size=4) if tiny else {}
        model = transformers.ViTModel(transformers.ViTConfig(**vit_small),
                                      add_pooling_layer=False)
        size = model.config.image_size

        def inputs(batch, device, dtype):
            return {"pixel_values": torch.randn(batch, 3, size, size, device=device, dtype=dtype)}
    else:
        raise ValueError(f"bench --model: model must be one of {MODELS}, got {name!r}")
    return model, inputs


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _liger(model):
    """Liger-Kernel's patches of the model's family (Llama, Qwen3-MoE) on this instance (RMSNorm,
    the MLP or experts' SwiGLU and, for a causal LM, its fused linear cross-entropy forward) and a
    context that swaps in its RoPE, a module-level function in transformers, around this model's
    steps only: the other models of the process keep theirs, and later builds the family's own
    classes."""
    import contextlib
    import importlib

    import liger_kernel.transformers as liger
    family = model.config.model_type
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    saved = dict(vars(modeling))
    getattr(liger, f"apply_liger_kernel_to_{family}")(
        model=model, fused_linear_cross_entropy=hasattr(model, "lm_head"))
    liger_rope = modeling.apply_rotary_pos_emb
    for n, v in saved.items():
        if vars(modeling).get(n) is not v:
            setattr(modeling, n, v)

    @contextlib.contextmanager
    def rope():
        modeling.apply_rotary_pos_emb = liger_rope
        try:
            yield
        finally:
            modeling.apply_rotary_pos_emb = saved["apply_rotary_pos_emb"]
    return rope


class _Variant:
    """One model with its optimizer and a training step (eager or compiled); `around`: a context
    each step runs in."""

    def __init__(self, model, device, precision: str, mode: str, distributed: bool = False,
                 around=None, opt=None, adamw: str = "torch"):
        import contextlib
        self.around = around or contextlib.nullcontext
        self.model, self.device, self.precision = model, device, precision
        self.opt = opt or optimizer(model, device, adamw, precision)
        if distributed:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
        self.forward = torch.compile(model) if mode == "compile" else model

    def step(self, inputs) -> None:
        with self.around(), torch.autocast(self.device.type, dtype=torch.bfloat16,
                                           enabled=self.precision == "autocast"):
            out = self.forward(**inputs)
            loss = out.loss if "labels" in inputs else \
                out.last_hidden_state.float().square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed_step(self, inputs) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        self.step(inputs)
        _sync(self.device)
        return (time.perf_counter() - t0) * 1e3

    def gpu_ms(self, inputs, steps: int = 3) -> tuple[float, float] | tuple[None, None]:
        """(all kernels but NCCL's, fusedlayers' kernels) in ms of GPU time per step."""
        if self.device.type != "cuda":
            return None, None
        # Kineto leaves CUPTI's callbacks installed after a session unless told to tear it down,
        # which slows every later CUDA call in the process: the cases timed after this one must
        # not pay for it.
        os.environ["TEARDOWN_CUPTI"] = "1"
        from torch.profiler import ProfilerActivity, profile
        _sync(self.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                self.step(inputs)
            _sync(self.device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "nccl" not in e.name.lower()]
        total = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps
        ours = sum(e.time_range.elapsed_us() for e in kernels
                   if "fusedlayers" in e.name) / 1e3 / steps
        return total, ours

    def peak_mb(self, inputs) -> float | None:
        if self.device.type != "cuda":
            return None
        _sync(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.step(inputs)
        _sync(self.device)
        return torch.cuda.max_memory_allocated(self.device) / 2**20


def optimizer(model, device, adamw: str = "torch", precision: str = "bf16"):
    """torch's AdamW (fused on CUDA) or fusedlayers.torch.AdamW (adamw="fusedlayers", and always
    for bf16-master: bf16 parameters with float32 masters and moments)."""
    if adamw == "fusedlayers" or precision == "bf16-master":
        from ..torch import AdamW
        return AdamW(model.parameters(), lr=1e-5, master_weights=precision == "bf16-master")
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")


def _first_forward_diff(unfused, fused, inputs, precision, device) -> float:
    outs = []
    for m in (unfused, fused):
        m.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                             enabled=precision == "autocast"):
            out = m(**inputs)  # a causal LM in eval: its logits, as unfused
            outs.append((out.logits if "labels" in inputs else out.last_hidden_state).double())
        m.train()
    return ((outs[1] - outs[0]).norm() / outs[0].norm()).item()


def run(name: str, device: str = "cuda", batches=None, precisions=None,
        modes=("eager", "compile"), rounds: int = 5, steps: int = 4, warmup: int = 3,
        tiny: bool = False, log=print, distributed: bool = False,
        peers: bool = False, layers: int | None = None, adamw: str = "torch",
        fp8: bool = False) -> list[ModelRow]:
    """Benchmarks model `name` over batches x precisions x modes; one ModelRow per case.
    `distributed`: under an initialized torch.distributed process group, each model in DDP.
    `peers`: the Llamas and the MoE in eager mode also with Liger-Kernel's patches (_liger), in
    the same rounds, where it imports. fp8: the FP8 variants too (module docstring).
    precisions: default DEFAULT_PRECISIONS, else autocast and bf16. adamw: "torch" (torch.optim.AdamW, fused on CUDA) or "fusedlayers" (its AdamW). layers: the decoder's layer count (default: the model's, or FLOAT32_LAYERS with float32
    parameters); a count other than the model's is named in the rows."""
    from ..torch import fuse
    precisions = precisions or DEFAULT_PRECISIONS.get(name, ("autocast", "bf16"))
    unknown = set(precisions) - {"autocast", "bf16", "bf16-master", "fp32"} | \
        set(modes) - {"eager", "compile"} | {adamw} - {"torch", "fusedlayers"}
    if unknown:
        raise ValueError(f"bench --model: precisions must be among autocast, bf16, bf16-master, "
                         f"fp32, modes among eager, compile and adamw torch or fusedlayers; got "
                         f"{sorted(unknown)}")
    dev = torch.device(device)
    if batches is None:
        batches = CPU_BATCHES if dev.type == "cpu" else DEFAULT_BATCHES[name]
    rows = []
    for precision in precisions:
        low = precision in ("bf16", "bf16-master")
        n_layers = layers or (None if tiny or low else FLOAT32_LAYERS.get(name))
        base, make_inputs = build(name, tiny, layers=n_layers)
        label = name if n_layers is None else f"{name} ({n_layers} layers)"
        if low:
            base = base.to(torch.bfloat16)
        base = base.to(dev).train()
        in_dtype = torch.bfloat16 if low else torch.float32
        for batch in batches:
            inputs = make_inputs(batch, dev, in_dtype)
            for mode in modes:
                # Fresh copies of the same weights for every case: no case trains on another's
                # (SHARED_WEIGHTS: one copy, one optimizer, each variant's forward on them).
                share = name in SHARED_WEIGHTS
                params = {id(p): p for p in base.parameters()} if share else {}
                opt = optimizer(base, dev, adamw, precision) if share else None
                not_run = {}
                unfused = copy.deepcopy(base, dict(params))
                fused = fuse(copy.deepcopy(base, dict(params)))
                diff = _first_forward_diff(unfused, fused, inputs, precision, dev)
                torch._dynamo.reset()  # each compiled case starts from an empty cache
                variants = {"unfused": _Variant(unfused, dev, precision, mode, distributed,
                                                opt=opt, adamw=adamw),
                            "fused": _Variant(fused, dev, precision, mode, distributed, opt=opt,
                                              adamw=adamw)}
                if peers and mode == "eager" and name.startswith(("llama", "qwen")) and \
                        _liger_imports():
                    liger = copy.deepcopy(base, dict(params))
                    variants["liger"] = _Variant(liger, dev, precision, mode, distributed,
                                                 around=_liger(liger), opt=opt, adamw=adamw)
                if fp8:
                    for k, make in _fp8_variants(base, params, peers).items():
                        try:
                            m, mode_k = make()
                        except Exception as e:  # noqa: BLE001 (a peer that does not convert)
                            if k not in FALLIBLE:  # our own variants' errors are raised
                                raise
                            not_run[k] = did_not_run(e)
                            continue
                        variants[k] = _Variant(m, dev, precision, mode_k or mode, distributed,
                                               opt=opt, adamw=adamw)
                t_start = time.perf_counter()

                def each(order, fn):
                    """fn(name, variant) for the variants in `order` still running; one that runs
                    out of memory (warming up, timed, profiled) stops there and its row says so."""
                    for k in order:
                        if k not in variants:
                            continue
                        try:
                            fn(k, variants[k])
                        except Exception as e:  # noqa: BLE001 (out of memory: the row says so)
                            if not out_of_memory(e) and k not in FALLIBLE:
                                raise
                            not_run[k] = did_not_run(e)
                            del variants[k]
                            if dev.type == "cuda":
                                torch.cuda.empty_cache()

                def warm(k, v):  # compiles, autotunes, fills caches
                    for _ in range(warmup):
                        v.step(inputs)
                each(list(variants), warm)
                times = {k: [] for k in variants}
                for r in range(rounds):
                    order = list(variants) if r % 2 == 0 else list(variants)[::-1]
                    each(order, lambda k, v: times[k].extend(
                        v.timed_step(inputs) for _ in range(steps)))
                gpu, peak = {}, {}
                each(list(variants), lambda k, v: gpu.__setitem__(k, v.gpu_ms(inputs)))
                each(list(variants), lambda k, v: peak.__setitem__(k, v.peak_mb(inputs)))
                gpu = {k: g for k, g in gpu.items() if k in variants}
                peak = {k: m for k, m in peak.items() if k in variants}
                times = {k: t for k, t in times.items() if k in variants}
                ms = {k: statistics.median(t) for k, t in times.items()}
                both = "unfused" in ms and "fused" in ms
                row = ModelRow(label, batch, precision, mode, ms.get("unfused"), ms.get("fused"),
                               ms["unfused"] / ms["fused"] if both else None,
                               *gpu.get("unfused", (None, None))[:1],
                               *gpu.get("fused", (None, None)), peak.get("unfused"),
                               peak.get("fused"), diff, ms.get("liger"), peak.get("liger"),
                               "; ".join(f"{k} did not run: {why}" for k, why in not_run.items()),
                               {k: {"ms": t, "gpu_ms": gpu.get(k, (None,))[0],
                                    "peak_mb": peak.get(k),
                                    "vs_fused": ms["fused"] / t if "fused" in ms else None}
                                for k, t in ms.items() if k not in ("unfused", "fused", "liger")})
                rows.append(row)
                log(f"{format_row(row)}   [{time.perf_counter() - t_start:.0f} s]")
                del variants, unfused, fused, opt
                liger = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


# Variants whose errors are rows (a peer's conversion or compile), not the bench's failure.
FALLIBLE = {"torchao tensorwise", "torchao rowwise"}


def _fp8_variants(base, params: dict, peers: bool) -> dict:
    """name -> make() returning (model, mode): fuse(model, fp8=) with each recipe (the case's
    mode; blockwise also keeping the forward's FP8 W^T, recompute_fp8_weights=False, and with
    the weight gradients' x^T in 128x128 tiles, wgrad_x_scaling="128x128") and, with peers,
    torchao's float8 training (compiled)."""
    from ..fp8_recipe import Fp8Recipe
    from ..torch import fuse
    recipes = {"fp8 blockwise": Fp8Recipe(), "fp8 tensorwise": Fp8Recipe("tensorwise"),
               "fp8 blockwise, W^T kept": Fp8Recipe(recompute_fp8_weights=False),
               "fp8 blockwise, x^T tiles": Fp8Recipe(wgrad_x_scaling="128x128")}
    out = {name: (lambda r=r: (fuse(copy.deepcopy(base, dict(params)), fp8=r), None))
           for name, r in recipes.items()}
    if peers:
        for r in ("tensorwise", "rowwise"):
            out[f"torchao {r}"] = lambda r=r: (_torchao(copy.deepcopy(base, dict(params)), r),
                                               "compile")
    return out


def _torchao(model, recipe: str):
    """torchao's float8 training on the model's linears but its LM head."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda module, fqn: fqn != "lm_head")


def _liger_imports() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


HEADER = (f"{'model':<10}{'batch':>6} {'precision':<11} {'mode':<8}{'unfused ms':>11}"
          f"{'fused ms':>10}{'speedup':>8}{'GPU ms unf':>11}{'GPU ms fus':>11}{'ours':>7}"
          f"{'peak MB unf':>12}{'peak MB fus':>12}{'fwd diff':>10}{'Liger ms':>10}"
          f"{'Liger MB':>10}")


def format_row(r: ModelRow) -> str:
    speedup = "-" if r.speedup is None else f"{r.speedup:.3f}x"
    return (f"{r.model:<10}{r.batch:>6} {r.precision:<11} {r.mode:<8}"
            f"{_f(r.unfused_ms, '11.2f'):>11}{_f(r.fused_ms, '10.2f'):>10}{speedup:>8}"
            f"{_f(r.unfused_gpu_ms, '11.2f'):>11}"
            f"{_f(r.fused_gpu_ms, '11.2f'):>11}{_f(r.fused_ours_gpu_ms, '7.2f'):>7}"
            f"{_f(r.unfused_peak_mb, '12.0f'):>12}{_f(r.fused_peak_mb, '12.0f'):>12}"
            f"{r.first_forward_rel_diff:>10.1e}{_f(r.liger_ms, '10.2f'):>10}"
            f"{_f(r.liger_peak_mb, '10.0f'):>10}" + (f"  {r.not_run}" if r.not_run else "") +
            "".join(f"\n  {k + ':':<35}{_f(v['ms'], '10.2f')} ms, "
                    f"{_f(v['vs_fused'], '.3f')}x fused, GPU {_f(v.get('gpu_ms'), '.2f')} ms, "
                    f"peak {_f(v['peak_mb'], '.0f')} MB"
                    for k, v in r.fp8.items()))


def format_table(rows: list[ModelRow], device_name: str) -> str:
    return "\n".join([f"device: {device_name}", HEADER, *map(format_row, rows)])


def write_json(path: str, rows: list[ModelRow], device_name: str) -> None:
    with open(path, "w") as f:
        json.dump({"device": device_name, "rows": [asdict(r) for r in rows]}, f, indent=1)


def plot(path: str, rows: list[ModelRow], device_name: str) -> None:
    """Speedup of the fused model per case (1.0 = as fast as unfused)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.speedup is not None]  # both variants ran
    labels = [f"{r.model} b{r.batch}\n{r.precision} {r.mode}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    ax.bar(range(len(rows)), [r.speedup for r in rows],
           color=["tab:green" if r.speedup >= 1 else "tab:red" for r in rows])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("training step speedup, fused / unfused")
    ax.set_ylim(min(0.9, *(r.speedup - 0.02 for r in rows)),
                max(1.1, *(r.speedup + 0.02 for r in rows)))
    ax.set_title(f"fusedlayers.torch.fuse on {device_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
