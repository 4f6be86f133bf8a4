"""`kvref size --plot`: the per-group curves are startup's bounds, and a PNG is written."""

from __future__ import annotations

from kvref.plot import blocks_by_length, plot_plan
from kvref.spec import EngineConfig, FullAttentionSpec, SlidingWindowSpec
from kvref.spec.planning import plan_kv_cache


def _gemma_like_plan():
    layers = {}
    for i in range(6):
        kw = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
        layers[f"l{i}"] = FullAttentionSpec(**kw) if i == 5 else SlidingWindowSpec(**kw, sliding_window=256)
    return plan_kv_cache(layers, EngineConfig(max_model_len=4096, max_num_batched_tokens=512), 512 * 2**20)


def test_curves_are_full_growth_and_capped_window():
    plan = _gemma_like_plan()
    per_group = blocks_by_length(plan, [1, 16, 17, 4096])
    kinds = [gp.kind for gp in plan.group_plans]
    full = per_group[kinds.index("FullAttentionSpec")]
    swa = per_group[kinds.index("SlidingWindowSpec")]
    assert full == [1, 1, 2, 256]
    cap = next(gp.admission_cap for gp in plan.group_plans if gp.admission_cap is not None)
    assert max(swa) == swa[-1] == cap == (256 - 1 + 512 + 15) // 16 + 1


def test_plot_writes_a_png(tmp_path):
    out = plot_plan(_gemma_like_plan(), str(tmp_path / "plan.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_identical_groups_share_one_line_and_the_total_lies_beneath():
    """Six sliding-window groups with the same curve are one labelled line, not six on top of each
    other; the whole-request line is drawn first, pale and wide, so the full-attention line (nearly
    equal to it at long lengths) stays visible on top (issue #16)."""
    import matplotlib.pyplot as plt

    from kvref.plot import build_figure, curve_series

    layers = {}
    for i in range(36):
        kw = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
        layers[f"l{i}"] = FullAttentionSpec(**kw) if i % 6 == 5 else SlidingWindowSpec(**kw, sliding_window=256)
    plan = plan_kv_cache(layers, EngineConfig(max_model_len=4096, max_num_batched_tokens=512), 512 * 2**20)
    assert len(plan.group_plans) == 6  # 30 sliding layers in 5 groups of 6, the 6 full layers in one
    series = curve_series(plan, [1, 1024, 4096])
    assert len(series) == 2
    swa = next(s for s in series if "SlidingWindowSpec" in s[0])
    assert len(swa[2]) == 5 and "5 identical" in swa[0]
    fig = build_figure(plan)
    try:
        lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
        total = lines["whole request (sum over groups)"]
        groups = [line for label, line in lines.items() if label.startswith("group")]
        assert len(groups) == 2
        assert all(g.get_zorder() > total.get_zorder() for g in groups)
        assert total.get_alpha() < 1 and total.get_linewidth() > max(g.get_linewidth() for g in groups)
    finally:
        plt.close(fig)


def _packaged_configs() -> list[list[str]]:
    """``kvref size`` arguments for every packaged example and config.json."""
    from importlib import resources

    root = resources.files("kvref") / "examples"
    out = [["--example", p.name.rsplit(".", 1)[0], "--available-memory", "40GiB"] for p in root.iterdir()
           if p.name.endswith((".json", ".toml"))]
    out += [["--hf-config", p.name[:-5], "--kv-cache-memory", "40GiB"]
            for p in (root / "hf_configs").iterdir() if p.name.endswith(".json")]
    return sorted(out)


def _plan_of(argv, monkeypatch, capsys):
    """The plan ``kvref size ARGV --plot`` would draw (the figure is built by the test)."""
    import kvref.plot as kp

    from kvref.cli import main

    seen = []
    monkeypatch.setattr(kp, "plot_plan", lambda plan, path, title=None: seen.append(plan) or path)
    for extra in (["--max-model-len", "32768"], []):  # the model's own limit where it is below 32k
        if main(["size", *argv, *extra, "--plot", "unused.png"]) == 0:
            break
    capsys.readouterr()
    return seen[-1] if seen else None


def test_every_line_is_readable_on_every_packaged_config(monkeypatch, capsys, tmp_path):
    """Issue #25: on linear axes the windowed groups lay on the x-axis under their admission-cap line,
    the legend covered the usable-blocks line, and for Llama-4 three quarters of the x-axis lay past
    max_model_len. Checked on the figure itself: the x-axis ends just past max_model_len, the y-axis
    is logarithmic where the lines' heights differ by orders of magnitude and shows every line, the
    legend lies outside the plot area."""
    import matplotlib.pyplot as plt

    from kvref.plot import LOG_RATIO, X_MARGIN, build_figure

    monkeypatch.chdir(tmp_path)
    plotted = 0
    for argv in _packaged_configs():
        plan = _plan_of(argv, monkeypatch, capsys)
        if plan is None:  # the pool cannot serve one request at 40 GiB: no plot to draw
            continue
        plotted += 1
        fig = build_figure(plan)
        try:
            ax = fig.axes[0]
            lo, hi = ax.get_xlim()
            assert lo == 0 and plan.max_model_len <= hi <= plan.max_model_len * X_MARGIN, (argv, hi)
            heights = [max(line.get_ydata()) for line in ax.get_lines() if line.get_label() and
                       not line.get_label().startswith("max_model_len")]
            positive = [h for h in heights if h > 0]
            spread = max(positive) / min(positive)
            assert (ax.get_yscale() == "log") == (spread > LOG_RATIO), (argv, spread, ax.get_yscale())
            bottom, top = ax.get_ylim()
            for line in ax.get_lines():
                if line.get_label().startswith("max_model_len"):
                    continue  # a vertical line: its y data are axes fractions
                ys = list(line.get_ydata())
                assert bottom <= min(ys) and max(ys) <= top, (argv, line.get_label(), ax.get_ylim())
            fig.canvas.draw()
            legend = ax.get_legend().get_window_extent()
            assert legend.x0 >= ax.get_window_extent().x1, (argv, "the legend overlaps the plot area")
        finally:
            plt.close(fig)
    assert plotted >= 20
