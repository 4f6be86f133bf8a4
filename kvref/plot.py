"""``kvref size --plot``: blocks one request holds per group against its length, with the caps.

The picture answers the question behind vLLM #39734 at a glance: where does each group's curve
flatten (the admission cap of sliding-window / chunked-local groups), how much does the whole
request take, and at which length does that cross the pool's usable blocks.
"""

from __future__ import annotations

from kvref.spec.planning import KVCachePlan


def blocks_by_length(plan: KVCachePlan, lengths: list[int]) -> list[list[int]]:
    """Per group, the blocks a request of each length holds at most (startup's per-request bound)."""
    out = []
    for gp in plan.group_plans:
        spec = gp.scheduler_spec
        out.append([spec.max_memory_usage_blocks(plan.config, max_model_len=n) for n in lengths])
    return out


def _lengths(max_len: int, points: int = 400) -> list[int]:
    step = max(1, max_len // points)
    xs = list(range(1, max_len + 1, step))
    if xs[-1] != max_len:
        xs.append(max_len)
    return xs


def curve_series(plan: KVCachePlan, xs: list[int]) -> list[tuple[str, list[int], list[int]]]:
    """``(label, blocks by length, group indices)``, one per *distinct* curve.

    Groups with the same kind and the same curve (Gemma-3's six sliding-window groups: each holds
    the same layers' worth of blocks) would be drawn exactly on top of each other, so they share
    one line labelled with their count; the whole request still counts every group.
    """
    per_group = blocks_by_length(plan, xs)
    series: dict[tuple, list[int]] = {}
    for i, (gp, ys) in enumerate(zip(plan.group_plans, per_group)):
        series.setdefault((gp.kind, gp.block_size, tuple(ys)), []).append(i)
    out = []
    for (kind, block, ys), groups in series.items():
        sizes = sorted({len(plan.group_plans[g].layer_names) for g in groups})
        layers = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        name = f"group {groups[0]}" if len(groups) == 1 else \
            f"groups {', '.join(map(str, groups))} ({len(groups)} identical)"
        out.append((f"{name}: {kind} ({layers} layers{' each' if len(groups) > 1 else ''}, block {block})",
                    list(ys), groups))
    return out


#: how far the x-axis runs past max_model_len (a margin, so the max_model_len line is not the frame)
X_MARGIN = 1.05
#: lines whose heights differ by more than this factor get a log y-axis: on a linear one the
#: windowed groups (a few blocks) lay on the x-axis under their admission-cap line (issue #25)
LOG_RATIO = 20.0


def _log_scale_needed(heights: list[float]) -> bool:
    positive = [h for h in heights if h > 0]
    return bool(positive) and max(positive) / min(positive) > LOG_RATIO


def build_figure(plan: KVCachePlan, title: str | None = None):
    """The matplotlib figure of :func:`plot_plan` (tests inspect its lines, axes and legend).

    Every line stays readable on every packaged config (issue #25): the x-axis ends just past
    ``max_model_len`` (how far the pool could serve beyond it is written in the legend, not drawn:
    Llama-4's pool serves 4x further, and three quarters of the picture lay past the model's limit);
    the y-axis is logarithmic when the lines' heights differ by orders of magnitude (a full-attention
    request of thousands of blocks beside sliding-window caps of a few, or a pool far larger than a
    request); the legend sits outside the plot area, so it covers no line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = _lengths(max(plan.max_model_len, 1))
    per_group = blocks_by_length(plan, xs)
    total = [sum(col) for col in zip(*per_group)] if per_group else [0] * len(xs)
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    # the whole request first, wide and pale, under the groups: a group that holds nearly all of it
    # (full attention beside capped windows) stays visible on top instead of disappearing beneath
    ax.plot(xs, total, color="black", linewidth=5, alpha=0.25, zorder=1, label="whole request (sum over groups)")
    caps_drawn: set[int] = set()
    styles = ["-", "--", "-.", ":"]
    heights = [max(total, default=0)]
    for n, (label, ys, groups) in enumerate(curve_series(plan, xs)):
        (line,) = ax.plot(xs, ys, label=label, linewidth=1.8, linestyle=styles[n % len(styles)], zorder=3)
        heights.append(max(ys, default=0))
        cap = plan.group_plans[groups[0]].admission_cap
        if cap is not None and cap not in caps_drawn:
            caps_drawn.add(cap)
            heights.append(cap)
            ax.axhline(cap, color=line.get_color(), linestyle=":", linewidth=1.2, zorder=2,
                       label=f"admission cap {cap} (group {groups[0]})")
    usable = plan.num_usable_blocks
    heights.append(usable)
    ax.axhline(usable, color="crimson", linestyle="--", linewidth=1.5, zorder=2,
               label=f"usable blocks ({usable:,} = {plan.num_blocks:,} - null)")
    beyond = f"; the pool serves up to {plan.max_servable_len:,}" if plan.max_servable_len > plan.max_model_len else ""
    ax.axvline(plan.max_model_len, color="grey", linestyle="-.", linewidth=1.2, zorder=2,
               label=f"max_model_len {plan.max_model_len:,}{beyond}")
    ax.set_xlim(0, plan.max_model_len * X_MARGIN)
    if _log_scale_needed(heights):
        ax.set_yscale("log")
        ax.set_ylim(0.8, max(heights) * 2)
    else:
        ax.set_ylim(0, max(heights) * 1.08)
    ax.set_xlabel("request length (tokens)")
    ax.set_ylabel("blocks held by one request" + (" (log scale)" if ax.get_yscale() == "log" else ""))
    ax.set_title(title or f"KV cache plan: {plan.num_blocks} blocks, max concurrency {plan.max_concurrency:.2f}x")
    ax.grid(True, alpha=0.3, which="both" if ax.get_yscale() == "log" else "major")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot_format(path: str, flag: str = "--plot") -> str:
    """The image format ``path`` names by its suffix (none: PNG). Checked before the plan is made:
    ``--plot plan.foo`` used to fail after the tables were printed, with matplotlib's message."""
    import os

    from matplotlib.backend_bases import FigureCanvasBase

    from kvref.spec.errors import InvalidFieldError

    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if suffix and suffix not in formats:
        raise InvalidFieldError(flag, path, "an image file name ending in ." + ", .".join(formats)
                                + " (or no suffix: PNG)")
    return suffix or "png"


def plot_plan(plan: KVCachePlan, path: str, title: str | None = None) -> str:
    """Draw the plan to ``path`` (PNG unless its suffix names another format) and return the path.
    The file is written at exactly ``path`` (matplotlib adds ``.png`` to a name without suffix)."""
    import matplotlib.pyplot as plt

    fig = build_figure(plan, title)
    fig.savefig(path, format=plot_format(path))
    plt.close(fig)
    return path
