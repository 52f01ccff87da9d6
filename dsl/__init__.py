"""The op DSL: an op registry with traits, and a graph builder in which architectures are written."""
from .graph import SOURCE_OPS, Graph, Node, Value
from .ops import REGISTRY, Kind, OpDef, ShapeError, get, register

__all__ = ["Graph", "Node", "Value", "SOURCE_OPS", "REGISTRY", "Kind", "OpDef", "ShapeError",
           "get", "register"]
