"""train.fast_exit: the exit handler freezes the survivors once, still finalizes garbage in reference cycles, is
registered once however often a run starts in the process, is not registered when the key is false, and leaves
the exit alone where a nanobind extension is loaded (it would report every frozen object of its as a leak)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = """
import atexit, gc, sys
# Registered first, so it runs last: after grpo's handler, before the interpreter's own teardown.
atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))
"""


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", PROBE + textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_survivors_are_frozen_garbage_cycles_are_still_finalized_and_the_handler_is_registered_once(tmp_path):
    marker = tmp_path / "finalized"
    out = run_python(f"""
        from grpo.training import process_exit
        handler = process_exit.collect_then_freeze

        def counted():
            print("handler ran", flush=True)
            handler()

        process_exit.collect_then_freeze = counted
        process_exit.exit_quickly(); process_exit.exit_quickly()

        class Cycle:
            def __init__(self):
                self.me = self
            def __del__(self):
                open({str(marker)!r}, "w").write("yes")

        gc.disable()  # nothing collects it before exit: only the handler's collection can
        Cycle()
    """)
    assert out.count("handler ran") == 1
    assert "frozen True" in out
    assert marker.read_text() == "yes"


def test_start_process_registers_it_unless_train_fast_exit_is_false():
    # torch's CUDA builds with a nanobind triton (torch 2.15's) import it through torch._dynamo: the handler then
    # registers but leaves the exit alone, so the expectation follows what this interpreter loads.
    code = """
        from grpo.config import load_config
        from grpo.training.process_exit import nanobind_loaded
        from grpo.training.prepare import start_process
        start_process(load_config(None, ["train.device=cpu", "train.fast_exit={}"]))
        print("nanobind", nanobind_loaded(), flush=True)
    """
    out = run_python(code.format("true"))
    assert ("frozen True" in out) == ("nanobind False" in out) and "frozen" in out
    assert "frozen False" in run_python(code.format("false"))


def test_a_loaded_nanobind_extension_keeps_pythons_own_exit():
    # nanobind's types have a metaclass it places in a module named "nanobind" (triton's libtriton on torch's CUDA
    # builds): an extension module holding one, in a submodule as nanobind's def_submodule makes them.
    out = run_python("""
        import types
        from grpo.training import process_exit

        meta = type("nb_meta", (type,), {"__module__": "nanobind"})
        extension, submodule = types.ModuleType("fake_ext"), types.ModuleType("fake_ext.ir")
        extension.__file__ = "/somewhere/fake_ext.cpython-311-x86_64-linux-gnu.so"
        submodule.builder = meta("builder", (), {})
        extension.ir = submodule
        print("before", process_exit.nanobind_loaded(), flush=True)
        sys.modules["fake_ext"] = extension
        print("after", process_exit.nanobind_loaded(), flush=True)
        process_exit.exit_quickly()
    """)
    assert "before False" in out and "after True" in out
    assert "frozen False" in out
