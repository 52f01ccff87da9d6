"""The graph compiler: lowering to networkx, fusion passes, scheduling and buffer planning."""
from .pipeline import FUSION_PASSES, compile_graph, compile_graphs, passes

__all__ = ["compile_graph", "compile_graphs", "passes", "FUSION_PASSES"]
