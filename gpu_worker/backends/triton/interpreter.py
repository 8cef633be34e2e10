"""Run the Triton kernels under Triton's interpreter on a machine without a CUDA device.

``@triton.jit`` picks between a compiled and an interpreted function when it decorates, reading
``TRITON_INTERPRET`` from the environment at that moment. That holds for triton's own library too:
``tl.max``, ``tl.sum``, ``tl.cdiv`` and the rest of ``triton.language.standard`` are decorated when
triton is first imported, and an interpreted kernel cannot call a compiled one ("Cannot call
@triton.jit'd outside of the scope of a kernel"). So the variable must be set before triton is
imported, and each kernel module calls ``use_interpreter_without_cuda()`` above its triton imports.
Where something imported triton earlier (torch.compile's inductor, a test), the call re-imports
triton's library modules so that they too are interpreted.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch


def use_interpreter_without_cuda() -> None:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device is present; an explicit setting wins."""
    if torch.cuda.is_available():
        return
    # Process-wide: kernels of other packages decorated after this point are interpreted too,
    # which is the only way they could run on such a machine anyway.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1" and "triton.language" in sys.modules:
        _interpret_triton_library()


def _interpret_triton_library() -> None:
    """Re-decorate ``triton.language``'s own jit functions if triton was imported in compiled mode."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(tl.standard.cdiv, InterpretedFunction):
        return
    library = (tl.standard, tl.random)
    for module in library:
        importlib.reload(module)  # runs their @jit again, now reading TRITON_INTERPRET=1
    # ``triton.language`` re-exports their functions by name (tl.max is tl.standard.max): rebind them.
    for name, value in list(vars(tl).items()):
        if isinstance(value, JITFunction):
            owners = [module for module in library if hasattr(module, name)]
            assert owners, f"triton.language.{name} is compiled and comes from no module reloaded here"
            setattr(tl, name, getattr(owners[0], name))
