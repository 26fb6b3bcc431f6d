"""Running flash-linear-attention's Triton kernels on CPU tensors, under Triton's interpreter.

This is how tests and benchmarks exercise the CUDA fast path on a machine without a GPU
(``TRITON_INTERPRET=1 clef-serve --kernels fast``). Two things stop fla's kernels from running there as
shipped (triton 3.9, fla 0.6), and :func:`prepare` works around both before fla is imported:

1. ``@triton.autotune`` benchmarks its configs through the GPU driver ("0 active drivers"): the autotuner is
   limited to the first config of each kernel, so nothing is benchmarked.
2. The interpreter hands ``for i in range(...)`` loop variables to kernels as Python ints, so a kernel that
   calls ``i.to(tl.int64)`` fails: the interpreter's source rewriter also turns each loop variable into an
   interpreter tensor at the top of the loop body.

bf16 is computed wrongly by the interpreter (it does arithmetic on raw bf16 bit patterns,
triton-lang/triton#11584): fp32 and f16 only. Nothing here is used on a GPU.
"""

from __future__ import annotations

import ast
import os

ENV = "TRITON_INTERPRET"

_prepared = False


def requested() -> bool:
    """``TRITON_INTERPRET=1`` is set (it must be, before Triton or fla is imported)."""
    return os.environ.get(ENV, "").strip() == "1"


def prepare() -> None:
    """Apply both work-arounds (idempotent). Raises ImportError when triton is not installed."""
    global _prepared
    if _prepared:
        return
    import triton.runtime.interpreter as interpreter
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def first_config_only(self, kwargs):  # type: ignore[no-untyped-def]
        return prune(self, kwargs)[:1]

    Autotuner.prune_configs = first_config_only

    class LoopVariablesAsTensors(interpreter.ASTTransformer):
        def visit_For(self, node: ast.For) -> ast.For:
            node = self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                name = node.target.id
                to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                          attr="to_tensor", ctx=ast.Load())
                convert = ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())],
                    value=ast.Call(func=to_tensor, args=[ast.Name(id=name, ctx=ast.Load()),
                                                         ast.Constant(value=False)], keywords=[]),
                )
                node.body.insert(0, convert)
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopVariablesAsTensors()
    _prepared = True
