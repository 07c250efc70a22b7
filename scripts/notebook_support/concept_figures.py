"""Notebook 00, sections 1 and 2: the figures of data against model parallelism and of ranks on two nodes. Notebook
support: a learner may skip this module.

Only drawing code: the notebook saves the figures with ``save_figure`` and its text carries the lesson.
"""
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

LAYERS = [("conv1", "#8ecae6"), ("conv2", "#90be6d"), ("fc1", "#f9c74f"), ("fc2", "#f4a261")]


def box(ax, x, y, w, h, text="", color="white", edge="0.35", size=9, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05,rounding_size=0.15", fc=color, ec=edge, lw=1.2))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)


def arrow(ax, start, end, text="", color="0.25", style="-|>", offset=(0, 0), size=8.5):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle=style, color=color, lw=1.6, shrinkA=2, shrinkB=2))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], text,
                ha="center", va="center", fontsize=size, color=color)


def gpu(ax, x, y, title, layers):
    box(ax, x, y, 3.6, 4.6, color="#f1f3f5")
    ax.text(x + 1.8, y + 4.25, title, ha="center", va="center", fontsize=9.5, weight="bold")
    for i, (name, color) in enumerate(layers):
        box(ax, x + 0.5, y + 3.1 - i * 0.95, 2.6, 0.7, name, color)


def data_vs_model_parallelism():
    """Section 1: two GPUs sharing a step, data parallel on the left, model parallel on the right."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax in (left, right):
        ax.set_xlim(0, 10)
        ax.set_ylim(0.6, 10.1)
        ax.axis("off")

    left.set_title("Data parallelism: a full copy of the model on every GPU,\n"
                   "each GPU gets a different shard of the batch", fontsize=10.5)
    box(left, 0.6, 8.1, 8.8, 1.85, color="white", edge="0.6")
    left.text(5, 9.6, "global batch: 64 images", ha="center", va="center", fontsize=9)
    box(left, 0.9, 8.3, 3.6, 0.85, "shard 0: images 0-31", "#e9ecef")
    box(left, 5.5, 8.3, 3.6, 0.85, "shard 1: images 32-63", "#e9ecef")
    gpu(left, 0.8, 2.6, "GPU 0 (rank 0)", LAYERS)
    gpu(left, 5.6, 2.6, "GPU 1 (rank 1)", LAYERS)
    arrow(left, (2.7, 8.3), (2.7, 7.25))
    arrow(left, (7.3, 8.3), (7.3, 7.25))
    arrow(left, (4.45, 4.9), (5.55, 4.9), style="<|-|>", color="#c1121f")
    left.text(5, 5.3, "all_reduce", ha="center", fontsize=8, color="#c1121f")
    left.text(5, 1.9, "after backward, all_reduce averages the gradients;\n"
                      "every copy takes the same step and stays identical",
              ha="center", va="top", fontsize=9, color="#c1121f")

    right.set_title("Model parallelism: one copy of the model, split by layers;\n"
                    "the whole batch passes through both GPUs", fontsize=10.5)
    box(right, 0.9, 8.3, 3.6, 0.85, "whole batch: 64 images", "#e9ecef")
    gpu(right, 0.8, 2.6, "GPU 0: layers 1-2", LAYERS[:2])
    gpu(right, 5.6, 2.6, "GPU 1: layers 3-4", LAYERS[2:])
    arrow(right, (2.7, 8.3), (2.7, 7.25))
    arrow(right, (4.45, 5.6), (5.55, 5.6), "activations", color="#1d3557", offset=(0, 0.35))
    arrow(right, (5.55, 4.1), (4.45, 4.1), "gradients", color="#c1121f", offset=(0, -0.35))
    right.text(5, 1.9, "activations go forward, gradients come back;\nwhile one GPU computes, the other waits",
               ha="center", va="top", fontsize=9, color="0.3")
    fig.tight_layout()
    return fig


def ranks_on_nodes(layout, nodes, gpus_per_node):
    """Section 2: one box per process of ``layout`` (dicts with node, local_rank, rank), grouped by node."""
    fig, ax = plt.subplots(figsize=(11, 3.6))
    ax.set_xlim(0, nodes * 5.2)
    ax.set_ylim(0, 3.6)
    ax.axis("off")
    for node in range(nodes):
        x0 = 0.1 + node * 5.2
        box(ax, x0, 0.15, 5.0, 3.0, color="#f1f3f5")
        role = ("node with GROUP_RANK 0: its host name\nis MASTER_ADDR (init_process_group's store)" if node == 0
                else f"node with GROUP_RANK {node}")
        ax.text(x0 + 2.5, 2.75, role, ha="center", va="center", fontsize=9.5, weight="bold")
    for p in layout:
        x = 0.35 + p["node"] * 5.2 + p["local_rank"] * 1.2
        box(ax, x, 0.4, 1.0, 1.85, f"rank {p['rank']}\n\nlocal rank\n{p['local_rank']}\n\ncuda:{p['local_rank']}",
            LAYERS[p["local_rank"] % len(LAYERS)][1], size=8.5)
    ax.set_title(f"torchrun --nnodes={nodes} --nproc-per-node={gpus_per_node}: world size {nodes * gpus_per_node}, "
                 "one process per GPU", fontsize=10.5)
    return fig
