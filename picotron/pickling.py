"""Code sent by value: what `run` sends to its ranks, `%ranks push` to live ranks, and the grader to a check.

A function defined in a notebook cell has no file a process could import it from, so it travels by
value, with cloudpickle (its code, and the notebook values it uses), with two repairs:

- cloudpickle 3.1 renames the file of every code object it copies to "<dynamic-code>" (2.x kept it),
  and a traceback, or Triton reading a kernel's source, finds a cell's lines by that name. So each
  code object is rebuilt however the installed cloudpickle rebuilds it, then given its own file name
  back (`code_with_file_name`), and the cells' lines travel with it (`cell_sources`).
- A @triton.jit kernel holds locks and cannot be pickled: it travels as its Python function and is
  made a kernel again on arrival (`jit_again`), from its source.

This module imports neither torch nor triton (a grader's cell in a learner's kernel uses it), only
cloudpickle, and that only when something is sent.
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import sys

__all__ = ["dumps", "cell_sources", "code_with_file_name", "jit_again", "write", "read"]


def dumps(obj, tensors_on_cpu: bool = False) -> bytes:
    """cloudpickle.dumps, keeping each code object's file name, with Triton kernels as their functions.

    tensors_on_cpu: every tensor travels as a CPU copy (requires_grad kept), so a GPU tensor can be sent to a
    process that has no GPU, or other GPUs (the ranks: `run`'s arguments, `%ranks push`). Unpickled as it is,
    a CUDA tensor would be rebuilt on its own device, and a rank that sees no GPU fails.
    """
    import types
    from collections import ChainMap

    import cloudpickle
    reduce_code = cloudpickle.Pickler.dispatch_table[types.CodeType]
    kernels = [getattr(sys.modules.get(module), name, None) for module, name in
               (("triton.runtime.jit", "JITFunction"), ("triton.runtime.interpreter", "InterpretedFunction"))]
    torch = sys.modules.get("torch")
    on_cpu = {}
    if tensors_on_cpu and torch is not None:
        # A Parameter pickles its .data, a plain tensor, which comes through here too.
        on_cpu[torch.Tensor] = lambda t: (t if t.device.type in ("cpu", "meta") else
                                          t.detach().cpu().requires_grad_(t.requires_grad)).__reduce_ex__(
            pickle.HIGHEST_PROTOCOL)

    class Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap(
            {types.CodeType: lambda code: (code_with_file_name, (*reduce_code(code)[:2], code.co_filename)),
             **{kind: (lambda kernel: (jit_again, (kernel.fn,))) for kind in kernels if kind is not None},
             **on_cpu},
            cloudpickle.Pickler.dispatch_table)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def cell_sources() -> dict:
    """The linecache entries of code that has no file (notebook cells), to send with the code."""
    return {name: entry for name, entry in list(linecache.cache.items())
            if len(entry) == 4 and entry[3] and not os.path.exists(name)}


def code_with_file_name(make, args: tuple, file_name: str):
    """On arrival: a code object copied by value, with its own file name back."""
    return make(*args).replace(co_filename=file_name)


def jit_again(fn):
    """On arrival: a Triton kernel again (compiled, or interpreted under TRITON_INTERPRET=1, as triton.jit decides
    in this process)."""
    import triton
    return triton.jit(fn)


def write(path: str, obj) -> None:
    """Write `obj` by value to `path`, after the cells' source lines (`read` puts them back first)."""
    payload = dumps(obj)
    with open(path, "wb") as f:
        pickle.dump(cell_sources(), f)
        f.write(payload)


def read(path: str):
    """What `write` wrote: the cells' lines go into linecache before the objects are rebuilt."""
    with open(path, "rb") as f:
        linecache.cache.update(pickle.load(f))
        return pickle.load(f)
