"""``python -m retrace.export.triton {env,write,serve}``: the Triton deployment from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from retrace.export.triton.env import TritonEnvError, default_cache_dir, ensure_triton_env
from retrace.export.triton.repository import RepositoryError, write_repository


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m retrace.export.triton",
                                 description="Triton Inference Server deployment of a ReTrace engine bundle.")
    ap.add_argument("--cache-dir", default=None,
                    help=f"tritonserver + model env cache (default: $RETRACE_TRITON_CACHE or {default_cache_dir()})")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="create (once) the cached tritonserver and the model's numpy<2 environment")
    w = sub.add_parser("write", help="write a model repository for an engine bundle")
    w.add_argument("bundle")
    w.add_argument("out", help="repository directory to create")
    w.add_argument("--name", default="retrace", help="model name (default: retrace)")
    w.add_argument("--instances", type=int, default=1, help="model instances (processes), each with its own runtime")
    w.add_argument("--max-batch", type=int, default=8, help="requests decoded together per instance")
    w.add_argument("--backend", default="onnxruntime", help="runtime backend (default: onnxruntime)")
    w.add_argument("--max-tokens", type=int, default=0, help="cap on max_tokens (0: from the bundle)")
    w.add_argument("--modes", default="retrace,dflash,ar", help="modes clients may ask for; first is the default")
    w.add_argument("--runtime-option", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for Runtime.from_bundle (VALUE parsed as JSON), e.g. threads=4")
    w.add_argument("--no-copy-bundle", action="store_true", help="reference the bundle by absolute path")
    g = w.add_mutually_exclusive_group()
    g.add_argument("--env", default=None, help="EXECUTION_ENV_PATH to use instead of the cached model env")
    g.add_argument("--no-env", action="store_true", help="no EXECUTION_ENV_PATH (the server's Python runs it)")
    w.add_argument("--force", action="store_true", help="replace an existing repository")
    s = sub.add_parser("serve", help="run the cached tritonserver on a repository (loopback, free ports)")
    s.add_argument("repository")
    s.add_argument("--log", default=None)
    s.add_argument("--model", action="append", default=[], help="wait until this model is ready")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "env":
            env = ensure_triton_env(args.cache_dir)
            for k, v in env.as_dict().items():
                print(f"{k}: {v}")
        elif args.cmd == "write":
            options = {}
            for item in args.runtime_option:
                key, sep, value = item.partition("=")
                if not sep or not key:
                    raise RepositoryError(f"--runtime-option wants KEY=VALUE, got {item!r}")
                try:
                    options[key] = json.loads(value)
                except ValueError:
                    options[key] = value
            env_path = args.env
            if env_path is None and not args.no_env:
                env_path = ensure_triton_env(args.cache_dir).model_env
            out = write_repository(
                args.bundle, args.out, model_name=args.name, instances=args.instances, max_batch=args.max_batch,
                copy_bundle=not args.no_copy_bundle, env_path=env_path, backend=args.backend,
                max_tokens=args.max_tokens, modes=args.modes.split(","), runtime_options=options or None,
                force=args.force,
            )
            print(f"wrote {out}/{args.name} (env: {env_path or 'server Python'})")
        else:
            from retrace.export import triton_server

            extra = ["--cache-dir", args.cache_dir] if args.cache_dir else []
            extra += ["--log", args.log] if args.log else []
            for m in args.model:
                extra += ["--model", m]
            return triton_server.main([args.repository, *extra])
    except (TritonEnvError, RepositoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
