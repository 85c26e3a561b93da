"""The papers' figures, drawn by the scripts' analyses when --plot FILE.png is given, and runs'
training curves (eval_sts.py --curves). matplotlib (headless, Agg) is imported here and only when a
figure is drawn, so the scripts run without it. A figure is a list of panels, each a dict: kind
"lines" (series {label: (xs, ys)}, optional marks [(x, y, text)]), "boxes" (groups {label:
values}), "heat" (a matrix with its row/column labels; colorbar=False: none) or "scatter" (points
{label: (x, y)}, each point named in the legend); every panel has a title and axis labels."""
import errno
import io
import os

import common
import harness


def labels(names):
    """{name: its label in a table or figure}: the base name of its folder (a run's best/: of the
    run folder, so RUN and RUN/best read alike), or the names themselves where base names clash."""
    runs = [harness.run_of(n) for n in names]
    short = [os.path.basename(os.path.normpath(r[1] if r and r[1] else n))
             for n, r in zip(names, runs)]
    return dict(zip(names, short if len(set(short)) == len(short) else names))


def check(path):
    """Before the analysis runs (so that a bad path costs nothing): a .png name in a writable
    folder, matplotlib."""
    if path is None:
        return
    if not path.lower().endswith(".png"):
        common.die(f"--plot '{path}': give a file name ending in .png")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        common.die(f"--plot '{path}': folder '{folder}' does not exist or is not writable: "
                   "create it first")
    pyplot()


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        common.die("--plot needs matplotlib: pip install matplotlib "
                   "(the version in requirements.txt)")
    return plt


def _lines(ax, pn):
    for label, (xs, ys) in pn["series"].items():
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    for x, y, text in pn.get("marks", []):
        ax.annotate(text, (x, y), xytext=(-14, -34), textcoords="offset points", ha="right",
                    fontsize=8, arrowprops=dict(arrowstyle="->", lw=0.8))
    if pn.get("integer_x", True):  # layers
        from matplotlib.ticker import MaxNLocator
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _boxes(ax, pn):
    labels = list(pn["groups"])
    ax.boxplot([pn["groups"][k] for k in labels], showmeans=True, meanprops=dict(markersize=4))
    for i, (x, y, text) in enumerate(pn.get("marks", [])):  # one marker a box, one legend entry
        ax.plot(x, y, "rx", markersize=9, label=text if i == 0 else None)
    if pn.get("marks"):
        ax.legend(fontsize=8)
    ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8, rotation=pn.get("rotate", 0))
    ax.grid(axis="y", alpha=0.3)


def _heat(ax, pn):
    im = ax.imshow(pn["matrix"], cmap="viridis", vmin=pn.get("vmin"), vmax=pn.get("vmax"))
    ax.set_xticks(range(len(pn["labels"])), pn["labels"], rotation=90, fontsize=7)
    ax.set_yticks(range(len(pn["labels"])), pn["labels"], fontsize=7)
    if pn.get("colorbar", True):
        ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=pn.get("cbar", ""))


def _scatter(ax, pn):
    for label, (x, y) in pn["points"].items():  # one colour a point, named in the legend
        ax.plot(x, y, "o", markersize=7, label=label)
    ax.margins(0.12)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


DRAW = {"lines": _lines, "boxes": _boxes, "heat": _heat, "scatter": _scatter}


def draw(path, panels, title, ncols=2, size=(5.4, 4.2)):
    """Panels on a grid of ncols columns, each size = (width, height) inches, saved as a 150-dpi
    PNG at path."""
    plt = pyplot()
    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows),
                             squeeze=False)
    for ax, pn in zip(axes.flat, panels):
        DRAW[pn["kind"]](ax, pn)
        ax.set_title(pn["title"], fontsize=10)
        ax.set_xlabel(pn.get("xlabel", ""))
        ax.set_ylabel(pn.get("ylabel", ""))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=150, format="png")
    from PIL import Image  # installed with matplotlib
    image = Image.open(buf).convert("RGB").quantize(256)  # a 256-colour palette: a third the size
    try:  # replaced whole: an older figure at path stays as it was if the write fails
        common.write_whole(path, lambda f: image.save(f, format="PNG", optimize=True))
    except OSError as e:
        full = "; free disk space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        kept = ", the older file is kept" if os.path.isfile(path) else ""
        common.die(f"--plot '{path}': cannot write it ({e.strerror or e}{kept}){full}: "
                   "pass a path in a writable folder")
    plt.close(fig)
    print(f"figure written: {path}")


def curves(runs):
    """The panels of runs' curves against the step ({label: its metrics.jsonl's rows}), a line a
    run: the step lines' training loss and gradient norm (before clipping), and the dev score."""
    panels = [{"kind": "lines", "title": t, "xlabel": "step", "ylabel": y, "series": {}}
              for t, y in (("training loss", "loss"), ("gradient norm before clipping", "gnorm"),
                           ("dev score", "score"))]
    names = set()  # the dev scores' names
    for label, rows in runs.items():
        dev = dev_scores(rows)
        points = [step_values(rows, "loss"), step_values(rows, "gnorm"),
                  [(step, v) for step, _, v in dev]]
        for pn, xy in zip(panels, points):
            if xy:
                pn["series"][label] = list(zip(*xy))
        names |= {k for _, k, _ in dev}
    panels[2]["ylabel"] = ", ".join(sorted(names)) or "score"
    return [pn for pn in panels if pn["series"]]


def step_values(rows, key):
    """[(step, value)] of the step lines' `key`; a value not finite is null in metrics.jsonl: left
    out."""
    return [(e["step"], e[key]) for e in rows if e.get(key) is not None]


def dev_scores(rows):
    """[(step, name, score)] of the dev lines (those without a loss)."""
    return [(e["step"], k, v) for e in rows if "loss" not in e for k, v in e.items() if k != "step"]


if __name__ == "__main__":  # a module of eval_sts.py and the analyses: nothing to run alone
    common.die("figures.py is a module: the figures are drawn by the analyses and eval_sts.py with "
               "--plot FILE.png (docs: the experiment map in README.md)")
