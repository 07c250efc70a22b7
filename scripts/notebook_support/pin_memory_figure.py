"""Notebook 01, section 6: the diagram of how a batch reaches the GPU, with and without ``pin_memory``. Notebook
support: a learner may skip this module.

Only drawing code: the notebook saves the figure with ``save_figure`` and its captions carry the lesson.
"""
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

PAGEABLE, PINNED, GPU, CPU_COPY, DMA = "#dee2e6", "#ffd6a5", "#caffbf", "#6c757d", "#c1121f"


def box(ax, x, y, w, h, text="", color="white", edge="0.35", size=9, weight="normal", style="-"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05,rounding_size=0.15",
                                fc=color, ec=edge, lw=1.2, ls=style))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)


def arrow(ax, start, end, text="", color="0.25", offset=0.15, size=8.5):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, lw=1.6, shrinkA=2, shrinkB=2))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + offset, text, ha="center", va="bottom",
                fontsize=size, color=color)


def draw():
    """The figure: two lanes, pin_memory=False above, pin_memory=True with workers below."""
    fig, ax = plt.subplots(figsize=(11, 5.0))
    ax.set_xlim(0, 11)
    ax.set_ylim(-0.75, 6.3)
    ax.axis("off")
    box(ax, 0.1, 0.0, 7.2, 5.8, color="#f8f9fa", edge="0.6")
    ax.text(3.7, 5.5, "host (CPU) memory", ha="center", fontsize=10, weight="bold")
    box(ax, 8.3, 0.0, 2.6, 5.8, color="#f8f9fa", edge="0.6")
    ax.text(9.6, 5.5, "GPU memory", ha="center", fontsize=10, weight="bold")

    # pin_memory=False: inside .to(device, non_blocking=True) the training thread copies the batch into the
    # driver's staging buffer, then the DMA runs.
    ax.text(0.3, 4.85, "pin_memory=False (default), then .to(device, non_blocking=True)", fontsize=9.5,
            weight="bold", va="center")
    box(ax, 0.4, 3.3, 2.2, 1.1, "batch in\npageable memory", PAGEABLE)
    box(ax, 4.6, 3.3, 2.2, 1.1, "pinned staging\nbuffer (driver's)", PINNED, style="--")
    box(ax, 8.6, 3.3, 2.0, 1.1, "batch", GPU)
    arrow(ax, (2.65, 3.85), (4.55, 3.85), "1. the training thread\ncopies it, inside .to", CPU_COPY)
    arrow(ax, (6.85, 3.85), (8.55, 3.85), "2. DMA", DMA)
    ax.text(3.7, 2.7, 'CUDA may return after copy 1, the DMA perhaps still running;\n'
                      'a plain .to("cuda") returns only after the DMA',
            ha="center", fontsize=8.5, color="0.3")

    # pin_memory=True: the loader's pin-memory thread does the host copy; the training thread starts one DMA.
    ax.text(0.3, 2.3, "pin_memory=True, num_workers > 0", fontsize=9.5, weight="bold", va="center")
    box(ax, 0.4, 0.75, 2.2, 1.1, "batch in\npageable memory", PAGEABLE)
    box(ax, 4.6, 0.75, 2.2, 1.1, "batch in\npinned memory", PINNED)
    box(ax, 8.6, 0.75, 2.0, 1.1, "batch", GPU)
    arrow(ax, (2.65, 1.3), (4.55, 1.3), "1. the loader's pin-memory\nthread copies it, meanwhile", CPU_COPY)
    arrow(ax, (6.85, 1.3), (8.55, 1.3), "2. DMA", DMA)
    ax.text(3.7, 0.35, "the training thread starts the DMA; with non_blocking=True it does not wait for it",
            ha="center", fontsize=8.5, color="0.3")
    ax.text(5.5, -0.5, "both ways the batch is copied twice; "
                       "with workers, pinning moves the host copy off the training thread",
            ha="center", fontsize=9, color="0.15")
    ax.set_title("How a batch gets from host memory to the GPU", fontsize=10.5)
    return fig
