"""The model card: ``loss.png`` (training and held-out curves) and ``README.md`` from the folder's logs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from cdb_train.train import LOG_FILE, read_metrics


def _smooth(xs: list[float], k: int = 5) -> list[float]:
    out = []
    for i in range(len(xs)):
        window = xs[max(0, i - k + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def plot_loss(folder: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = json.loads((folder / LOG_FILE).read_text())
    args = log["args"]
    tokens_per_step = args["batch"] * args["seq"]
    tr, ev = log["train"], log["eval"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["step"] * tokens_per_step / 1e6 for r in tr]
    a1.plot(x, _smooth([r["loss"] for r in tr]), label="objective (exit-weighted CE - beta * entropy)", color="k")
    depth = len(tr[0]["ce"])
    for d in range(depth):
        a1.plot(x, _smooth([r["ce"][d] for r in tr]), label=f"CE at depth {d + 1}", lw=0.9)
    a1.set_xlabel("training tokens (millions)")
    a1.set_ylabel("nats / token")
    a1.set_title("training batches (moving average of 5 logs)")
    a1.set_ylim(top=min(8.0, max(r["loss"] for r in tr)))
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    xe = [r["step"] * tokens_per_step / 1e6 for r in ev]
    for d in range(depth):
        a2.plot(xe, [r["ppl_per_depth"][d] for r in ev], marker=".", label=f"depth {d + 1}")
    a2.plot(xe, [r["ppl_mixture"] for r in ev], marker=".", color="k", ls="--", label="exit-weighted mixture")
    a2.set_yscale("log")
    a2.set_xlabel("training tokens (millions)")
    a2.set_ylabel("perplexity")
    a2.set_title(f"held-out perplexity ({args['eval_windows']} windows of {args['seq']} tokens)")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path = folder / "loss.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _data_lines(d: dict[str, Any]) -> list[str]:
    if "version" not in d:  # documents given directly (tests)
        return [
            f"- Corpus: {d['package']}; {d['train_tokens']:,} training and {d['heldout_tokens']:,} held-out tokens."
        ]
    return [
        f"- Corpus: the King James Version of the Bible (1611) from the Debian package `{d['package']}` version "
        f"{d['version']} (`{d['deb']}`, sha256 `{d['deb_sha256'][:16]}...`), file `{d['data_file']}`.",
        f"- Licence: {d['licence']}. The package's copyright file: \"The copyright for the King James Version text "
        'of the Bible is expired since the translation was done in 1611"; the Bible Retrieval System files are '
        '"provided for unrestricted use".',
        "- Preprocessing: the file's 64 KiB LZW blocks (Unix `compress` format) are decoded (`cdb_train.corpus`); "
        "the title line and the verse references (`Ge1:1`) are dropped; one chapter is one document, verses "
        "separated by newlines, documents separated by `<|endoftext|>` in the token stream.",
        f"- Split: {d['chapters']} chapters / {d['verses']} verses; held out: {d['heldout_rule']} "
        f"({d['heldout_chapters']} chapters, first {', '.join(d['heldout_first'][:3])}, ...). Training: "
        f"{d['train_chapters']} chapters, {d['train_tokens']:,} tokens; held-out: {d['heldout_tokens']:,} tokens.",
    ]


def render(m: dict[str, Any], folder_name: str, hf_config: dict[str, Any] | None = None) -> str:
    d, t, h, mc = m["data"], m["training"], m["heldout"], m["model"]
    cfg = mc["config"]
    max_pos = (hf_config or {}).get("max_position_embeddings", "?")
    depth = cfg["total_ut_steps"]
    q = h["threshold"]
    lines = [
        f"# {folder_name}: a small Ouro-architecture looped LM trained on the King James Bible",
        "",
        "Built to be the project's default model for `make run` / `cdb demo`: real weights whose exit gate has "
        "learned which tokens are easy, small enough to ship in the repository and to serve on a CPU. Same "
        "architecture, tensor names and `config.json` fields as ByteDance's Ouro-1.4B (shared block looped "
        f"{depth} times, final RMSNorm after every step, exit gate on each step's normed state), scaled down.",
        "",
        "## Model",
        "",
        _row(["parameters", "hidden", "layers in the looped block", "heads (kv)", "SwiGLU", "vocab", "loop steps"]),
        _row(["---"] * 7),
        _row(
            [
                f"{mc['parameters']:,}" + (f" (+ {cfg['hidden_size'] + 1} lookahead gate)" if "lookahead" in m else ""),
                cfg["hidden_size"],
                cfg["num_hidden_layers"],
                f"{cfg['num_attention_heads']} ({cfg['num_key_value_heads']})",
                cfg["intermediate_size"],
                cfg["vocab_size"],
                depth,
            ]
        ),
        "",
        "Stored in bf16 like the upstream release (`model.safetensors`, upstream tensor names, plus "
        "`model.lookahead_exit_gate.{weight,bias}`). RoPE theta 10,000; trained on windows of "
        f"{t['seq']} tokens (`max_position_embeddings` {max_pos} allows longer contexts, at lower quality). "
        f"`early_exit_threshold` = {q} in `config.json` (the serving default).",
        "",
        "## Data",
        "",
        *_data_lines(d),
        f"- Tokenizer: byte-level BPE trained with `tokenizers` on the training split, {cfg['vocab_size']} ids; "
        "0/1/2 = `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (as in Ouro); ChatML chat template (the model "
        "never saw chat data).",
        "",
        "## Training",
        "",
        "Ouro's objective: per target token, the language-model losses of the LM head after each loop step "
        "weighted by the exit distribution of the gate, minus an entropy regulariser on that distribution "
        f"(`sum_t p_t CE_t - beta H(p)`, beta = {t['beta']}), end to end; p_t = lambda_t prod_(j<t) (1 - lambda_j), "
        "the last step taking the remainder.",
        "",
        f"- {t['steps']} AdamW steps of {t['batch']} x {t['seq']} tokens ({t['tokens_seen'] / 1e6:.2f} M tokens, "
        f"{t['tokens_seen'] / d['train_tokens']:.1f} epochs), seed {t['seed']}, {t['threads']} CPU thread.",
        f"- Wall time of training on the build machine (2 CPU cores shared with other work, one thread used): "
        f"{t['wall_s'] / 60:.1f} min" + (f" (process CPU time {t['cpu_s'] / 60:.1f} min)." if "cpu_s" in t else "."),
        "",
        "```",
        "OMP_NUM_THREADS=1 python -m cdb_train prepare",
        "OMP_NUM_THREADS=1 " + t["command"],
    ]
    la = m.get("lookahead")
    if la:
        lines.append("OMP_NUM_THREADS=1 " + la["distillation"]["command"])
    lines += [
        f"python -m cdb_train card --model models/{folder_name}",
        "```",
        "",
        "![loss curve](loss.png)",
        "",
        "## Held-out results",
        "",
        f"All {h['tokens']:,} held-out tokens, windows of {t['seq']}, every token run to full depth (teacher "
        "forcing), figures from the shipped bf16 weights:",
        "",
        _row(["", *[f"depth {i + 1}" for i in range(depth)], "exit-weighted mixture", f"served depth at q = {q}"]),
        _row(["---"] * (depth + 3)),
        _row(["perplexity", *h["ppl_per_depth"], h["ppl_mixture"], h["ppl_at_threshold"]]),
        _row(["mean exit probability", *h["exit_pdf_mean"], "", ""]),
        _row(
            [
                f"served depth at q = {q} (same-step)",
                *[_pct(x) for x in h["depth_histogram_at_threshold"]],
                "",
                f"mean {h['mean_depth_at_threshold']}",
            ]
        ),
        "",
        f"Best depth on average: {1 + h['ppl_per_depth'].index(min(h['ppl_per_depth']))}; depth 1 has "
        f"{h['ppl_per_depth'][0] / min(h['ppl_per_depth']):.2f} x the best perplexity while the deeper steps differ "
        "little at this scale, so the gate spreads its exit mass over depths 2..4 and a token's depth turns on "
        "small differences.",
        "",
        'The mixture is `-log sum_t p_t softmax_t(y)`; "served depth" exits at the first step whose exit CDF '
        f"reaches q (the mean exit entropy is {h['exit_entropy_mean']} nats, uniform over {depth} steps would be "
        f"{math.log(depth):.3f}).",
    ]
    prof = h.get("depth_profile")
    if prof:

        def toks(rows: list[dict[str, Any]]) -> str:
            return ", ".join(f"`{r['token']!r}` {r['mean_depth']}" for r in rows)

        lines += [
            "",
            f"What the gate learned (q = {prof['threshold']}, same-step): mean held-out loss at full depth of the "
            "tokens served at depth 1..4: "
            + " / ".join("-" if x is None else str(x) for x in prof["loss_at_full_depth_by_served_depth"])
            + " nats. Frequent tokens served shallowest on average: "
            + toks(prof["shallowest_tokens"][:8])
            + "; deepest: "
            + toks(prof["deepest_tokens"][:8])
            + ".",
        ]
    if la:
        lines += [
            "",
            "## Lookahead gate",
            "",
            "`model.lookahead_exit_gate` (Linear(hidden, 1) on each step's normed state) predicts the same-step "
            "gate's hazard one step later, so one-step-ahead exit decisions need neither an extra step nor a wait. "
            "Distilled from the frozen same-step gate on the training split: binary cross-entropy on the hazard "
            "plus the mean absolute difference of the exit CDFs the one-ahead rule computes, both folded to the "
            f"minimum exit depth of 2 (`cdb_train.lookahead`; {la['distillation']['wall_s']:.0f} s).",
            "",
            "Held-out tokens, decisions by the scheduler's own rule (`cdb_scheduler.exit_policy.OuroHazard`). "
            "Agreement: the served depth of one-ahead + lookahead equals the same-step depth at minimum depth 2 "
            "(tokens), and the per-step exit/continue decisions that agree (decisions):",
            "",
            _row(
                [
                    "q",
                    "agreement (tokens)",
                    "agreement (decisions)",
                    "mean depth same-step",
                    "one-ahead + lookahead gate",
                    "one-ahead + same-step gate (one step late)",
                    "same-step, min depth 2",
                ]
            ),
            _row(["---"] * 7),
        ]
        for r in la["by_threshold"]:
            lines.append(
                _row(
                    [
                        r["threshold"],
                        _pct(r["agreement_tokens"]),
                        _pct(r["agreement_decisions"]),
                        r["mean_depth_same_step"],
                        r["mean_depth_one_ahead_lookahead"],
                        r["mean_depth_one_ahead_same_gate"],
                        r["mean_depth_same_step_min2"],
                    ]
                )
            )
        lines += [
            "",
            _row(
                [
                    "q",
                    *[f"same-step depth {i + 1}" for i in range(depth)],
                    *[f"one-ahead + lookahead depth {i + 1}" for i in range(1, depth)],
                ]
            ),
            _row(["---"] * (2 * depth)),
        ]
        for r in la["by_threshold"]:
            lines.append(
                _row(
                    [
                        r["threshold"],
                        *[_pct(x) for x in r["hist_same_step"]],
                        *[_pct(x) for x in r["hist_one_ahead_lookahead"][1:]],
                    ]
                )
            )
        default = next(r for r in la["by_threshold"] if r["threshold"] == la["default_threshold"])
        lines += [
            "",
            f"At q = {default['threshold']}, served depths 1..{depth}: same-step "
            f"{' / '.join(_pct(x) for x in default['hist_same_step'])}; one-ahead + lookahead "
            f"{' / '.join(_pct(x) for x in default['hist_one_ahead_lookahead'])}; one-ahead + same-step gate "
            f"{' / '.join(_pct(x) for x in default['hist_one_ahead_same_gate'])}.",
        ]
    lines += [
        "",
        "## Use",
        "",
        "```",
        f"cdb demo --model models/{folder_name}",
        f"python -c \"from cdb_model.loader import load_model; print(load_model('models/{folder_name}').config)\"",
        "```",
        "",
        "A 2-layer model trained for under an hour on a CPU: it writes KJV-flavoured English, not sense. "
        "`heldout_sample.txt` and `metrics.json` (`heldout_sample`) hold a fixed held-out slice and its figures "
        "for the tests (`tests/train`).",
        "",
    ]
    return "\n".join(lines)


SAMPLE_PROMPT = "And God said unto Moses,"


def sample_generation(folder: Path, prompt: str = SAMPLE_PROMPT, max_new_tokens: int = 40) -> str:
    """One sampled continuation through the reference path, ``token[depth]``: the config's threshold, one-step-ahead
    decisions (with the lookahead gate when the checkpoint has one), ``last_exited`` KV; temperature 0.8, seed 7."""
    from cdb_model.kv import KVLayout, KVPolicy
    from cdb_model.loader import load_model, load_tokenizer
    from cdb_model.reference import reference_generate
    from cdb_scheduler.exit_policy import Horizon, OuroHazard
    from cdb_scheduler.sampling import SamplingParams

    model = load_model(str(folder))
    tok = load_tokenizer(str(folder))
    c = model.config
    out = reference_generate(
        model,
        tok.encode(prompt),
        max_new_tokens=max_new_tokens,
        policy=OuroHazard(c.early_exit_threshold, c.max_depth, 1, Horizon.ONE_AHEAD),
        kv_layout=KVLayout(KVPolicy.LAST_EXITED, c.max_depth),
        sampling=SamplingParams(temperature=0.8, seed=7),
    )
    return prompt + "".join(f"{tok.decode([t])}[{d}]" for t, d in zip(out.tokens, out.depths, strict=True))


def write_card(folder: Path) -> None:
    plot_loss(folder)
    text = render(read_metrics(folder), folder.name, json.loads((folder / "config.json").read_text()))
    sample = sample_generation(folder)
    text = text.replace(
        "\n## Use\n",
        "\n## Sample\n\nThe reference path (`cdb_model.reference`), the config's threshold, one-step-ahead decisions "
        "with the lookahead gate, `last_exited` KV, temperature 0.8, seed 7; `token[served depth]`, the first token "
        "from the full-depth prefill:\n\n```\n" + sample + "\n```\n\n## Use\n",
    )
    (folder / "README.md").write_text(text)
