"""LoRA training of a diffusers UNet in SD1.5 and SDXL configurations, once per attention backend:
the kernels (through rdna_flash_attn's diffusers processor, or the SDPA override), PyTorch SDPA's
math backend (what ZLUDA users get) and SDPA's flash backend. Same random init, same LoRA init and
same data for every backend; records it/s, peak VRAM, loss curves and the dispatcher's counters to
JSON and a PNG, and judges the kernels' loss curve against the math-vs-flash disagreement.

    RDNA_FA_FORCE=1 python -m bench.lora_training --out bench/results          # NVIDIA test GPU
    python -m bench.lora_training --tiny --out /tmp/lora                        # CPU, tiny models

Defaults follow the issue: 1024 px images (128x128 latents), batch 1, rank 32 LoRA on the attention
projections, fp16 autocast with a GradScaler, 50 steps. Training time has a bound (--budget-seconds,
shared out over the runs still to come, at most --max-run-seconds each): a run that reaches its share
stops early, and curves are compared over the steps every backend finished.

On NVIDIA the kernels run through the gfx11 emulation build (RDNA_FA_EMULATE=gfx12 for the other):
their speed there says nothing about RDNA; their loss curve and memory do.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

import rdna_flash_attn
from rdna_flash_attn.integrations.diffusers_attention import install_attention_processor

BACKENDS = ("kernels", "math", "flash")
RUN_ORDER = ("math", "flash", "kernels")  # the slowest (kernels, emulated) last: it gets what the budget has left
CONFIGS = ("sd15", "sdxl")
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
WARMUP_STEPS = 2  # left out of it/s: first-use self-test, cuDNN/cuBLAS autotuning, allocator growth


# --- models and data ----------------------------------------------------------------------------------

def unet_config(name: str, tiny: bool) -> dict:
    """UNet2DConditionModel arguments: SD1.5's or SDXL's layout, or a tiny model with the same
    block structure (and head dims the kernels take) for a CPU check."""
    if name == "sd15":
        config = dict(  # diffusers' defaults are SD1.5's UNet; spelled out for the reader
            in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
            attention_head_dim=8, cross_attention_dim=768,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
        if tiny:
            config.update(layers_per_block=1, block_out_channels=(32, 64, 64, 64), attention_head_dim=4,
                          cross_attention_dim=32, norm_num_groups=8)
        return config
    config = dict(  # SDXL base
        in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816)
    if tiny:
        config.update(layers_per_block=1, block_out_channels=(32, 64, 64), transformer_layers_per_block=(1, 1, 2),
                      attention_head_dim=(2, 4, 4), cross_attention_dim=64, addition_time_embed_dim=8,
                      projection_class_embeddings_input_dim=32 + 6 * 8, norm_num_groups=8)
    return config


def text_shapes(name: str, tiny: bool) -> dict:
    """Shapes of the random text conditioning: (tokens, width) of encoder_hidden_states and, for SDXL,
    the pooled text embedding width (time_ids are 6 numbers)."""
    config = unet_config(name, tiny)
    shapes = dict(tokens=77, width=config["cross_attention_dim"])
    if name == "sdxl":
        shapes["pooled"] = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
    return shapes


def make_data(name: str, tiny: bool, steps: int, latent_size: int, seed: int) -> list[dict]:
    """Per-step inputs, drawn on the CPU from one seeded generator: identical for every backend."""
    generator = torch.Generator().manual_seed(seed + 1)
    shapes = text_shapes(name, tiny)
    # SD's scaled-linear noise schedule, for realistic noisy latents at the sampled timesteps
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1 - betas, 0).float()
    data = []
    for _ in range(steps):
        latents = torch.randn(1, 4, latent_size, latent_size, generator=generator)
        noise = torch.randn(1, 4, latent_size, latent_size, generator=generator)
        timestep = torch.randint(0, 1000, (1,), generator=generator)
        alpha = alphas_cumprod[timestep].view(1, 1, 1, 1)
        step = dict(noisy=alpha.sqrt() * latents + (1 - alpha).sqrt() * noise, noise=noise, timestep=timestep,
                    context=torch.randn(1, shapes["tokens"], shapes["width"], generator=generator))
        if name == "sdxl":
            original = torch.tensor([[latent_size * 8.0, latent_size * 8.0, 0.0, 0.0, latent_size * 8.0,
                                      latent_size * 8.0]])  # original size, crop, target size
            step["added"] = dict(text_embeds=torch.randn(1, shapes["pooled"], generator=generator), time_ids=original)
        data.append(step)
    return data


def build_unet(name: str, tiny: bool, device: torch.device, weight_dtype: torch.dtype, rank: int, seed: int):
    """Random-init UNet in `weight_dtype` with a float32 peft LoRA on the attention projections;
    seeded so that every backend trains the very same weights."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    torch.manual_seed(seed)
    with torch.device(device):
        unet = UNet2DConditionModel(**unet_config(name, tiny))
    unet.to(dtype=weight_dtype).requires_grad_(False)
    torch.manual_seed(seed + 2)
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    lora = [p for p in unet.parameters() if p.requires_grad]
    for parameter in lora:  # trainable weights in float32, as diffusers' and kohya's LoRA scripts keep them
        parameter.data = parameter.data.float()
    return unet, lora


# --- one training run ---------------------------------------------------------------------------------

def attention_context(backend: str, route: str, unet):
    """What makes attention run on `backend` for the run's duration."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "kernels":
        if route == "processor":
            install_attention_processor(unet)
            return contextlib.nullcontext()
        return rdna_flash_attn.patch_sdpa()
    return sdpa_kernel(SDPBackend.MATH if backend == "math" else SDPBackend.FLASH_ATTENTION)


def train(name: str, backend: str, args, device: torch.device, allowance_seconds: float, seed: int) -> dict:
    precision = dict(fp16=torch.float16, bf16=torch.bfloat16, fp32=torch.float32)[args.precision]
    on_gpu = device.type == "cuda"
    unet, lora = build_unet(name, args.tiny, device, precision if on_gpu else torch.float32, args.rank, seed)
    optimizer = torch.optim.AdamW(lora, lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    data = make_data(name, args.tiny, args.steps, args.latent_size, seed)

    rdna_flash_attn.reset_stats()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, step_seconds, skipped_steps = [], [], 0
    started = time.perf_counter()
    with attention_context(backend, args.route, unet):
        for step_inputs in data:
            step_started = time.perf_counter()
            inputs = {k: v.to(device) if torch.is_tensor(v) else {n: t.to(device) for n, t in v.items()}
                      for k, v in step_inputs.items()}
            with torch.autocast(device.type, dtype=precision, enabled=args.precision != "fp32"):
                prediction = unet(inputs["noisy"], inputs["timestep"], inputs["context"],
                                  added_cond_kwargs=inputs.get("added")).sample
            loss = torch.nn.functional.mse_loss(prediction.float(), inputs["noise"])
            optimizer.zero_grad(set_to_none=True)
            scale = scaler.get_scale() if scaler.is_enabled() else 1.0
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if scaler.is_enabled() and scaler.get_scale() < scale:  # inf/NaN gradients: step skipped
                skipped_steps += 1
            losses.append(loss.item())  # synchronises: the step is done
            step_seconds.append(time.perf_counter() - step_started)
            if time.perf_counter() - started > allowance_seconds:
                break
    timed = step_seconds[WARMUP_STEPS:] or step_seconds
    result = dict(
        losses=losses, steps_done=len(losses), stopped_early=len(losses) < len(data),
        allowance_seconds=allowance_seconds, seconds=time.perf_counter() - started,
        it_per_s=len(timed) / sum(timed), skipped_steps=skipped_steps, stats=rdna_flash_attn.stats(),
        peak_vram_mib=torch.cuda.max_memory_allocated() / 2**20 if on_gpu else None,
        lora=[p.detach().float().cpu().clone() for p in lora])
    del unet, lora, optimizer
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return result


# --- comparison, report ------------------------------------------------------------------------------

def max_relative_difference(a: list[float], b: list[float]) -> float:
    steps = min(len(a), len(b))
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a[:steps], b[:steps])), default=math.nan)


def max_weight_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).norm() / y.norm().clamp_min(1e-12)).item() for x, y in zip(a, b))


def agreement(runs: dict) -> dict:
    """The kernels' loss curve against both SDPA backends, with the tolerance set by how far SDPA's
    math and flash backends disagree with each other on the same run: kernels pass when they are no
    further from either than 2x that (plus 1e-6 for runs where both SDPA backends agree exactly)."""
    if not all(b in runs and "losses" in runs[b] for b in BACKENDS):
        return dict(judged=False, reason="a backend did not run")
    losses = {b: runs[b]["losses"] for b in BACKENDS}
    reference = max_relative_difference(losses["flash"], losses["math"])
    tolerance = 2 * reference + 1e-6
    vs_math = max_relative_difference(losses["kernels"], losses["math"])
    vs_flash = max_relative_difference(losses["kernels"], losses["flash"])
    result = dict(
        judged=True, steps_compared=min(len(v) for v in losses.values()),
        loss_flash_vs_math=reference, loss_kernels_vs_math=vs_math, loss_kernels_vs_flash=vs_flash,
        loss_tolerance=tolerance, loss_curves_agree=max(vs_math, vs_flash) <= tolerance)
    if len({len(v) for v in losses.values()}) != 1:
        # Weights after different numbers of steps differ by the steps, not by the attention.
        result["lora_weights"] = "not compared: the runs stopped after different numbers of steps"
        return result
    weights = {b: runs[b]["lora"] for b in BACKENDS}
    result.update(
        lora_weights_flash_vs_math=max_weight_difference(weights["flash"], weights["math"]),
        lora_weights_kernels_vs_math=max_weight_difference(weights["kernels"], weights["math"]),
        lora_weights_kernels_vs_flash=max_weight_difference(weights["kernels"], weights["flash"]))
    return result


def seed_spread(losses: dict[str, list[list[float]]]) -> dict:
    """The kernels' loss curves against SDPA's own seed-to-seed spread (SDPA's math backend, or flash
    where math did not run): per step, the kernels' mean over seeds must lie within the lowest and
    highest loss SDPA reached over the same seeds. Also how far each kernel curve is from SDPA's at the
    same seed, against how far SDPA's seeds are from each other."""
    reference = "math" if losses.get("math") else "flash"
    if not losses.get("kernels") or not losses.get(reference) or len(losses[reference]) < 2:
        return dict(judged=False, reason="fewer than two seeds of the kernels and of SDPA")
    steps = min(len(curve) for backend in ("kernels", reference) for curve in losses[backend])
    sdpa = [[curve[t] for curve in losses[reference]] for t in range(steps)]
    kernels = [[curve[t] for curve in losses["kernels"]] for t in range(steps)]
    means = [sum(values) / len(values) for values in kernels]
    inside = [min(ref) <= mean <= max(ref) for ref, mean in zip(sdpa, means)]
    same_seed = max(abs(k - r) / max(abs(r), 1e-12) for ks, rs in zip(kernels, sdpa) for k, r in zip(ks, rs))
    spreads = sorted((max(ref) - min(ref)) / max(sum(ref) / len(ref), 1e-12) for ref in sdpa)
    return dict(judged=True, reference=reference, seeds=len(losses[reference]), steps_compared=steps,
                kernels_mean_inside_sdpa_seed_range=all(inside), steps_inside=sum(inside),
                envelope=dict(low=[min(ref) for ref in sdpa], high=[max(ref) for ref in sdpa], kernels_mean=means),
                same_seed_max_relative_gap=same_seed, sdpa_seed_spread_median_relative=spreads[len(spreads) // 2])


def plot_seeds(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(result["seed_spread"])
    figure, axes = plt.subplots(1, len(configs), figsize=(7 * len(configs), 4.5), squeeze=False)
    for axis, config in zip(axes[0], configs):
        verdict = result["seed_spread"][config]
        if not verdict.get("judged"):
            axis.set_title(f"{config}: {verdict['reason']}")
            continue
        envelope, steps = verdict["envelope"], range(verdict["steps_compared"])
        axis.fill_between(steps, envelope["low"], envelope["high"], color="tab:gray", alpha=0.35,
                          label=f"SDPA {verdict['reference']}: range over {verdict['seeds']} seeds")
        for index, curve in enumerate(result["seed_losses"][config]["kernels"]):
            axis.plot(curve[: verdict["steps_compared"]], color="tab:blue", linewidth=0.8, alpha=0.6,
                      label="kernels, each seed" if index == 0 else None)
        axis.plot(envelope["kernels_mean"], color="tab:red", linewidth=2, label="kernels, mean over seeds")
        axis.set(xlabel="step", ylabel="MSE loss",
                 title=f"{config}: kernels' mean inside SDPA's seed range at {verdict['steps_inside']} of "
                       f"{verdict['steps_compared']} steps\nsame-seed gap {verdict['same_seed_max_relative_gap']:.1e}, "
                       f"SDPA seed spread (median) {verdict['sdpa_seed_spread_median_relative']:.2f}")
        axis.legend(fontsize=8)
    figure.suptitle(result["meta"]["title"])
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(result["runs"])
    figure, axes = plt.subplots(2, max(2, len(configs)), figsize=(6 * max(2, len(configs)), 8), squeeze=False)
    styles = dict(kernels=dict(linestyle="--", linewidth=1.5), math=dict(linewidth=3, alpha=0.5),
                  flash=dict(linestyle=":", linewidth=1.5))
    for column, config in enumerate(configs):
        axis = axes[0][column]
        for backend, run in result["runs"][config].items():
            if "losses" in run:
                axis.plot(run["losses"], label=backend, **styles[backend])
        verdict = result["agreement"][config]
        title = f"{config}: LoRA loss"
        if verdict.get("judged"):
            title += (f"\nkernels vs math {verdict['loss_kernels_vs_math']:.1e}, flash vs math "
                      f"{verdict['loss_flash_vs_math']:.1e} ({'agree' if verdict['loss_curves_agree'] else 'DISAGREE'})")
        axis.set(xlabel="step", ylabel="MSE loss", title=title)
        axis.legend()
    for column, (key, label) in enumerate([("it_per_s", "it/s"), ("peak_vram_mib", "peak VRAM (MiB)")]):
        axis = axes[1][column]
        width = 0.8 / len(BACKENDS)
        for index, backend in enumerate(BACKENDS):
            values = [result["runs"][c].get(backend, {}).get(key) or 0 for c in configs]
            axis.bar([i + index * width for i in range(len(configs))], values, width, label=backend)
        axis.set_xticks([i + width for i in range(len(configs))], configs)
        axis.set(ylabel=label, title=label)
        axis.legend()
    figure.suptitle(f"{result['meta']['title']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: sd15,sdxl")
    parser.add_argument("--backends", default=",".join(RUN_ORDER), help="comma-separated, in run order")
    parser.add_argument("--steps", type=int, help="training steps per run (default 50; 3 with --tiny)")
    parser.add_argument("--resolution", type=int,
                        help="image size in pixels, latents are 1/8 of it (default 1024; 64 with --tiny)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--precision", choices=("fp16", "bf16", "fp32"),
                        help="autocast dtype, fp16 with a GradScaler; base weights in it on the GPU "
                             "(default fp16; bf16 with --tiny)")
    parser.add_argument("--route", choices=("processor", "override"), default="processor",
                        help="how the kernels run reaches them: the diffusers processor or the SDPA override")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1,
                        help="seeds per backend (--seed, --seed + 1, ...): each draws its own LoRA init, latents, "
                             "noise and timesteps, the same for every backend; with 2 or more the kernels' loss is "
                             "judged against SDPA's seed-to-seed spread too (JSON and PNG <name>_seeds)")
    parser.add_argument("--budget-seconds", type=float, default=240.0,
                        help="training time of all runs together; each run gets an equal share of what is left")
    parser.add_argument("--max-run-seconds", type=float, default=90.0, help="training time of one run at most")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny models, 64 px, 3 steps, bf16 on the CPU: proves the script runs without a GPU")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="lora_training", help="file name stem of the JSON and PNG")
    args = parser.parse_args(argv)
    for key, full, tiny in (("steps", 50, 3), ("resolution", 1024, 64), ("precision", "fp16", "bf16")):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    args.latent_size = args.resolution // 8
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    configs = [c for c in args.configs.split(",") if c]
    backends = [b for b in args.backends.split(",") if b]
    assert set(configs) <= set(CONFIGS) and set(backends) <= set(BACKENDS), (configs, backends)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    import diffusers
    import peft

    diffusers.utils.logging.set_verbosity_error()  # its dtype-cast advice, once per run, is not for us

    meta = dict(device=device_name, torch=torch.__version__, diffusers=diffusers.__version__, peft=peft.__version__,
                settings=dict(force=rdna_flash_attn.settings.force, training=rdna_flash_attn.settings.training),
                args={k: str(v) for k, v in vars(args).items()},
                title=(f"{'tiny ' if args.tiny else ''}UNet LoRA r{args.rank}, {args.resolution} px, batch 1, "
                       f"{args.precision}, {device_name}"))
    runs: dict = {}  # the first seed's runs, judged as before
    seed_losses: dict = {config: {backend: [] for backend in backends} for config in configs}
    started = time.perf_counter()
    training_seconds = 0.0
    seeds = range(args.seed, args.seed + args.seeds)
    runs_left = len(configs) * len(backends) * len(seeds)
    for config in configs:
        runs[config] = {}
        for seed in seeds:
            for backend in backends:
                allowance = min(args.max_run_seconds, max(args.budget_seconds - training_seconds, 0) / runs_left)
                runs_left -= 1
                print(f"{config} / {backend} / seed {seed} (up to {allowance:.0f} s) ...", file=sys.stderr, flush=True)
                try:
                    run = train(config, backend, args, device, allowance, seed)
                    training_seconds += run["seconds"]
                    seed_losses[config][backend].append(run["losses"])
                except Exception as exc:  # e.g. flash unavailable, out of memory: record it, go on
                    run = dict(error=f"{type(exc).__name__}: {exc}")
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                if seed == args.seed:
                    runs[config][backend] = run
                summary = {k: v for k, v in run.items() if k not in ("losses", "lora")}
                print(f"{config} / {backend} / seed {seed}: {json.dumps(summary)}", file=sys.stderr, flush=True)
    result = dict(meta=meta, runs=runs, agreement={c: agreement(runs[c]) for c in configs},
                  total_seconds=time.perf_counter() - started)
    for config_runs in runs.values():
        for run in config_runs.values():
            run.pop("lora", None)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{args.name}.png")
    spread_verdicts = None
    if args.seeds > 1:
        spread = dict(meta=meta, seeds=list(seeds), seed_losses=seed_losses,
                      seed_spread={c: seed_spread(seed_losses[c]) for c in configs})
        (args.out / f"{args.name}_seeds.json").write_text(json.dumps(spread, indent=1))
        plot_seeds(spread, args.out / f"{args.name}_seeds.png")
        spread_verdicts = {c: {k: v for k, v in verdict.items() if k != "envelope"}
                           for c, verdict in spread["seed_spread"].items()}
    print(json.dumps(dict(agreement=result["agreement"], seed_spread=spread_verdicts,
                          total_seconds=result["total_seconds"]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
