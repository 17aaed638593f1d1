"""graph.onnx: the artifact's FX graph stored as a normal ONNX model, and read back exactly.

``export_graph_to_onnx`` writes a GraphModule as an ONNX ModelProto (default opset 18 plus
domain ``ai.octavo`` version 1) that ``onnx.checker`` accepts and Netron opens; ATen ops
with an exact ONNX equivalent become standard ops, the rest ``ai.octavo`` nodes.
``import_graph_from_onnx`` rebuilds the identical GraphModule from the per-node templates,
without importing or evaluating anything from the file. The format is described in
``octavo.ir.onnx_mapping``.
"""

from octavo.ir.onnx_export import InputSpecs, export_graph_to_onnx, save_onnx
from octavo.ir.onnx_import import import_graph_from_onnx

__all__ = ["InputSpecs", "export_graph_to_onnx", "import_graph_from_onnx", "save_onnx"]
