"""The process-wide ONNX Runtime thread pool (Engine.load(shared_thread_pool=True)): decoding stays exact, DSpark's
own later sessions (the row-invariance kernel probe) still load, and the CLI uses it unless told not to."""
import json
import os
import subprocess
import sys
import textwrap


def _run(code: str, env_pool: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("DSPARK_SHARED_THREAD_POOL", None)
    if env_pool is not None:
        env["DSPARK_SHARED_THREAD_POOL"] = env_pool
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_shared_pool_decodes_exactly_and_later_sessions_still_load(tiny_engine_dir):
    res = _run(f"""
        import json
        from dspark_runtime import Engine
        from dspark_runtime.backends import ort as backend
        from dspark_runtime.machine.row_invariance import kernel_row_difference
        eng = Engine.load({str(tiny_engine_dir)!r}, threads=2, shared_thread_pool=True)
        ref = eng.generate("def add(a, b):", max_new_tokens=24, draft=None).token_ids
        spec = eng.generate("def add(a, b):", max_new_tokens=24, draft="lm", draft_length=3).token_ids
        diff = kernel_row_difference(2, 2, rows=8, blocks=(1, 2))  # a plain session made after the pool
        from threadpoolctl import threadpool_info
        blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
        print(json.dumps({{"pool": backend._SHARED_POOL_THREADS, "same": ref == spec, "n": len(ref),
                           "diff": float(diff), "blas": blas}}))
    """)
    assert res["pool"] == 2 and res["same"] and res["n"] == 24 and res["diff"] >= 0
    # numpy's BLAS runs one thread beside the shared pool (its threads fought the pool's for the cores)
    assert res["blas"] and all(n == 1 for n in res["blas"])


def test_cli_default_and_opt_out():
    code = """
        import json
        from dspark_runtime.backends.ort import shared_pool_default
        print(json.dumps({"on": shared_pool_default()}))
    """
    assert _run(code)["on"] is True
    assert _run(code, "0")["on"] is False
