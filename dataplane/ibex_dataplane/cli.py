"""The ``ibex`` command: the composition root that builds settings once and wires stores, stages and reconcile.

Subcommands:
- ``ibex dev``: embedded stores, migrations, local tenant manifests, API keys, the data plane (proxy, memory and
  context stages); Ctrl-C stops it all.
- ``ibex proxy`` / ``ibex memory`` / ``ibex context``: one data-plane stage as its own process.
- ``ibex eval locomo FILE``: evidence recall of the public memory search on fresh embedded stores.
- ``ibex migrate``: apply pending Postgres and ClickHouse migrations to the configured stores.
- ``ibex wait-schema``: wait, bounded, until someone else (the operator) has applied the Postgres migrations.
- ``ibex mcp``: a stdio MCP server that forwards to a proxy's ``/mcp`` (for clients that only launch processes).
- ``ibex operator``: the kopf operator that reconciles the four custom resources into the stores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from aiohttp import web

from ibex_dataplane.context.app import ContextStage
from ibex_dataplane.memory.app import create_memory_app
from ibex_dataplane.providers.catalog import CatalogConfigError, ModelCatalog, catalog_for, load_provider_config
from ibex_dataplane.providers.registry import ProviderRegistry
from ibex_dataplane.proxy.app import create_app
from ibex_dataplane.runtime.embedded import EmbeddedRuntime, RuntimeHolder, RuntimeInfo, runtime_holder
from ibex_dataplane.runtime.errors import DataDirInUse, EmbeddedStoreError
from ibex_dataplane.runtime.heap import HEAP
from ibex_dataplane.runtime.stores import Stores, StoreUrls, load_or_create_secret, migrate_all, migrations_dir
from ibex_dataplane.runtime.workers import WorkerContext, WorkerLaunch, supervise, usable_cpus
from ibex_dataplane.security.principal import PrincipalSigner
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.clickhouse import ClickHouse
from ibex_dataplane.store.errors import StoreError
from ibex_dataplane.store.migrations import wait_for_postgres_schema

log = logging.getLogger("ibex")


class _Stop(Exception):
    """Raised by the SIGTERM handler outside the event loop so clean-up still runs."""


def _configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("presidio-anonymizer", "kopf", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    # Presidio warns once per recognizer of a language we do not load (es, it, pl ...) at every start: expected
    # with an English-only registry, so only its errors are shown.
    logging.getLogger("presidio-analyzer").setLevel(max(logging.ERROR, logging.getLogger().level))


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def _write_keys(path: Path, keys: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(keys, f, indent=2, sort_keys=True)
        f.write("\n")
    tmp.replace(path)


async def _migrated_stores(runtime: EmbeddedRuntime, settings: Settings) -> Stores:
    """Migrate the embedded stores, then open every client (with the privileged pool, for reconcile)."""
    urls = StoreUrls.from_runtime(runtime.info)
    clickhouse = ClickHouse(urls.clickhouse_url)
    try:
        await migrate_all(urls, settings, clickhouse)
    finally:
        await clickhouse.close()
    return await Stores.open(urls, settings, admin=True)


@contextlib.asynccontextmanager
async def _data_plane(settings: Settings, stores: Stores, pepper: bytes, host: str, port: int) -> AsyncIterator[str]:
    """The memory and context stages and the proxy in this process, as `ibex dev` runs them; yields the proxy's
    base URL."""
    from ibex_dataplane.embedding.onnx import OnnxMiniLMEmbedder
    from ibex_dataplane.pii.redactor import PiiRedactor

    # The memory stage on a free local port; the proxy reaches it with principals signed by a per-run secret.
    embedder = await asyncio.to_thread(OnnxMiniLMEmbedder.from_installed_packages, settings.memory_embedding_precision)
    redactor: PiiRedactor | None = None
    memory_runner: web.AppRunner | None = None
    context: ContextStage | None = None
    runner: web.AppRunner | None = None
    try:
        redactor = await asyncio.to_thread(
            PiiRedactor, threshold=settings.pii_threshold, enable_ner=settings.pii_enable_ner
        )
        secret = (
            settings.internal_secret.get_secret_value().encode()
            if settings.internal_secret
            else secrets.token_bytes(32)
        )
        memory_app = create_memory_app(settings, stores, embedder=embedder, redactor=redactor, secret=secret)
        memory_runner = web.AppRunner(memory_app, access_log=None, handle_signals=False)
        await memory_runner.setup()
        await web.TCPSite(memory_runner, settings.memory_host, 0).start()
        memory_url = f"http://{settings.memory_host}:{memory_runner.addresses[0][1]}"
        # The context stage (gRPC) on a free local port too, reaching the memory stage the same way.
        context = ContextStage(
            settings, catalog=_catalog(settings), memory_url=memory_url, secret=secret, host=settings.context_host,
            port=0,
        )  # fmt: skip
        await context.start()

        app = create_app(
            settings, stores, pepper=pepper, memory_url=memory_url, context_url=context.address,
            principal_signer=PrincipalSigner(secret), embedder=embedder,
        )  # fmt: skip
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1] if runner.addresses else port
        frozen = app[HEAP].freeze()  # one heap for the three stages, frozen once; each reports it on its /metrics
        for heap in (memory_app[HEAP], context.metrics.heap):
            heap.frozen.set(frozen)
        yield f"http://{host}:{bound}"
    finally:
        if runner is not None:
            await runner.cleanup()
        if context is not None:
            await context.stop()
        if memory_runner is not None:
            await memory_runner.cleanup()
        if redactor is not None:
            redactor.close()
        embedder.close()


@dataclass(frozen=True)
class DevKey:
    """An API key `ibex dev` issued from the manifests, as it presents it."""

    ref: str  # <namespace>/<ApiKey name>
    token: str
    organization: str
    agents: tuple[str, ...]
    scopes: tuple[str, ...]
    model: str  # the default model of its first agent (else of its organization, else echo)


def _default_models(resources: Sequence[object]) -> dict[tuple[str, str], str]:
    """(namespace, agent name) -> the model a request naming none would get."""
    from ibex_operator.models import Agent, Organization

    orgs = {
        (r.metadata.namespace, r.metadata.name): r.spec.models.default
        for r in resources
        if isinstance(r, Organization) and r.spec.models.default
    }
    out: dict[tuple[str, str], str] = {}
    for r in resources:
        if isinstance(r, Agent):
            model = r.spec.default_model or orgs.get((r.metadata.namespace, r.spec.organization_ref.name))
            if model:
                out[(r.metadata.namespace, r.metadata.name)] = model
    return out


def dev_welcome(base_url: str, keys: Sequence[DevKey], keys_file: Path, *, python: str) -> str:
    """What `ibex dev` prints once it is ready: the keys with what they may do, and a curl command and an OpenAI
    SDK snippet that work as pasted (with the first key that may chat)."""
    lines = [f"API keys (also in {keys_file}):"]
    for k in keys:
        lines.append(f"  {k.ref}: {k.token}")
        lines.append(f"    organization {k.organization}; acts as {', '.join(k.agents)}; scopes {', '.join(k.scopes)}")
    chat = next((k for k in keys if "chat" in k.scopes), None)
    if chat is None:
        lines.append("No key has the chat scope: give one `chat` in the manifests to call models.")
        return "\n".join(lines)
    agent = chat.agents[0]
    body = json.dumps({"model": chat.model, "messages": [{"role": "user", "content": "Hello"}]})
    lines += [
        "",
        f"Try it as {agent} with {chat.ref}:",
        f"curl -s {base_url}/v1/chat/completions \\",
        f'  -H "Authorization: Bearer {chat.token}" -H "X-IBEX-Agent-ID: {agent}" \\',
        f"  -H \"Content-Type: application/json\" -d '{body}'",
        "",
        "or with the OpenAI SDK:",
        f"{python} - <<'PY'",
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{base_url}/v1", api_key="{chat.token}",',
        f'                default_headers={{"X-IBEX-Agent-ID": "{agent}"}})',
        f'reply = client.chat.completions.create(model="{chat.model}",',
        '                                       messages=[{"role": "user", "content": "Hello"}])',
        "print(reply.choices[0].message.content)",
        "PY",
        "",
    ]
    return "\n".join(lines)


async def _serve_dev(args: argparse.Namespace, settings: Settings, runtime: EmbeddedRuntime, started: float) -> int:
    from ibex_operator.manifests import ManifestError, apply_manifests, load_manifests
    from ibex_operator.models import ApiKey
    from ibex_operator.reconcile import Reconciler
    from ibex_operator.repository import TenantConfigRepository
    from ibex_operator.secrets import FileSecretSink

    try:
        manifests = load_manifests(Path(args.manifests))
    except ManifestError as e:
        print(f"ibex dev: invalid manifest: {e}", file=sys.stderr)
        return 2

    stores = await _migrated_stores(runtime, settings)
    try:
        assert stores.admin_pool is not None
        pepper = (
            settings.key_pepper.get_secret_value().encode()
            if settings.key_pepper
            else load_or_create_secret(runtime.data_dir / "pepper")
        )
        sink = FileSecretSink(runtime.data_dir / "secrets.json")
        reconciler = Reconciler(TenantConfigRepository(stores.admin_pool, stores.redis), sink, pepper)
        outcomes = await apply_manifests(reconciler, manifests)
        for o in outcomes:
            flag = "ready" if o.ready else "NOT READY"
            print(f"  {o.ref}: {flag} ({o.reason}{': ' + o.message if o.message and not o.ready else ''})")

        resources = [m.resource for m in manifests]
        models = _default_models(resources)
        keys: list[DevKey] = []
        for r in resources:
            if isinstance(r, ApiKey) and not r.spec.revoked:
                token = await sink.read(r.metadata.namespace, r.spec.secret_name)
                if token:
                    agents = tuple(a.name for a in r.spec.agent_refs)
                    keys.append(
                        DevKey(
                            f"{r.metadata.namespace}/{r.metadata.name}", token, r.spec.organization_ref.name, agents,
                            tuple(s.value for s in r.spec.scopes),
                            models.get((r.metadata.namespace, agents[0])) or "echo",
                        )
                    )  # fmt: skip
        keys.sort(key=lambda k: k.ref)
        keys_out = Path(args.keys_out) if args.keys_out else runtime.data_dir / "keys.json"
        _write_keys(keys_out, {k.ref: k.token for k in keys})

        async with _data_plane(settings, stores, pepper, args.host, args.port) as base_url:
            runtime.lock.announce(base_url)  # for the messages of commands that find this data dir taken
            print(dev_welcome(base_url, keys, keys_out, python=sys.executable), flush=True)
            print(f"ibex dev ready in {time.monotonic() - started:.1f}s: {base_url} (Ctrl-C to stop)", flush=True)
            await _wait_for_signal()
        print("ibex dev: stopping", flush=True)
        return 0
    finally:
        await stores.close()


def cmd_dev(args: argparse.Namespace, settings: Settings) -> int:
    started = time.monotonic()
    data_dir = Path(args.data_dir) if args.data_dir else settings.data_dir
    runtime = EmbeddedRuntime(data_dir)
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        try:
            runtime.start()
        except DataDirInUse as e:
            print(
                f"ibex dev: {_who(RuntimeHolder(e.pid, e.url))} is already running on {e.data_dir}: use it, stop it"
                " first, or give this one another --data-dir",
                file=sys.stderr,
            )
            return 2
        except EmbeddedStoreError as e:
            print(f"ibex dev: cannot start embedded stores: {e}", file=sys.stderr)
            return 1
        print(f"embedded stores up under {runtime.data_dir}", flush=True)
        try:
            import uvloop

            return uvloop.run(_serve_dev(args, settings, runtime, started))
        except (StoreError, EmbeddedStoreError) as e:
            print(f"ibex dev: {e}", file=sys.stderr)
            return 1
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with contextlib.suppress(Exception):
            runtime.stop()
        signal.signal(signal.SIGTERM, previous)


async def _wait_for_signal(lifeline: int | None = None) -> None:
    """Until SIGINT or SIGTERM (or, for a proxy worker, until its supervisor's end of ``lifeline`` closes)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if lifeline is not None:
        loop.add_reader(lifeline, stop.set)  # readable only at end of file: the supervisor is gone
    try:
        await stop.wait()
    finally:
        if lifeline is not None:
            loop.remove_reader(lifeline)


async def _serve_app(app: web.Application, host: str, port: int, name: str, worker: WorkerLaunch | None = None) -> None:
    """Listen until SIGINT/SIGTERM, after printing the `ready` line with the bound URL. A proxy ``worker`` shares
    the port (SO_REUSEPORT) and tells its supervisor instead, which prints the line once for all."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_port=worker is not None).start()
        bound = runner.addresses[0][1] if runner.addresses else port
        if HEAP in app:
            app[HEAP].freeze()  # startup is over: later full collections skip what it allocated (runtime/heap.py)
        if worker is None:
            print(f"ibex {name} ready: http://{host}:{bound}", flush=True)
        else:
            os.write(worker.ready_fd, b"ready\n")
            os.close(worker.ready_fd)
        await _wait_for_signal(worker.lifeline_fd if worker is not None else None)
    finally:
        await runner.cleanup()


def _run_stage(
    name: str,
    args: argparse.Namespace,
    settings: Settings,
    serve: Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int]],
) -> int:
    """One data-plane stage as its own process, on `IBEX_*` stores or those of `ibex dev --data-dir`."""
    if getattr(args, "data_dir", None):
        settings = settings.model_copy(update={"data_dir": Path(args.data_dir)})
    try:
        import uvloop

        return uvloop.run(serve(args, settings))
    except (StoreError, EmbeddedStoreError) as e:
        print(f"ibex {name}: {e}", file=sys.stderr)
        return 1


def _who(holder: RuntimeHolder) -> str:
    details = [f"pid {holder.pid}"] if holder.pid else []
    details += [f"serving {holder.url}"] if holder.url else []
    return "`ibex dev`" + (f" ({', '.join(details)})" if details else "")


def _engine_holder(settings: Settings, urls: StoreUrls) -> RuntimeHolder | None:
    """The running ``ibex dev`` whose embedded ClickHouse engine ``urls`` would open, if any: chdb opens a data
    path in one process only, so a second process can neither migrate it nor ever report ready on it."""
    if not urls.clickhouse_url.startswith("chdb:"):
        return None
    try:
        if RuntimeInfo.read(settings.data_dir / "runtime.json").clickhouse_url != urls.clickhouse_url:
            return None
    except EmbeddedStoreError:
        return None
    return runtime_holder(settings.data_dir)


def _proxy_preflight(settings: Settings) -> tuple[StoreUrls, bytes] | int:
    """The proxy's store URLs and key pepper, or the exit code after saying why it cannot start (checked before
    anything opens, in the supervisor too: each worker would fail the same way)."""
    urls = StoreUrls.from_settings(settings)
    holder = _engine_holder(settings, urls)
    if holder is not None:
        print(
            f"ibex proxy: {_who(holder)} holds the embedded ClickHouse engine of {settings.data_dir} (it opens in one"
            " process only), so this proxy could never become ready. `ibex dev` already serves a proxy; to run"
            " another beside it, give this one a ClickHouse of its own: IBEX_CLICKHOUSE_URL=http://... (a server)"
            " or chdb:///another/folder",
            file=sys.stderr,
        )
        return 2
    if settings.key_pepper:
        return urls, settings.key_pepper.get_secret_value().encode()
    pepper_file = settings.data_dir / "pepper"
    if not pepper_file.exists():
        print("ibex proxy: set IBEX_KEY_PEPPER (or run next to `ibex dev`'s data dir)", file=sys.stderr)
        return 2
    return urls, load_or_create_secret(pepper_file)


async def _serve_proxy(args: argparse.Namespace, settings: Settings) -> int:
    preflight = _proxy_preflight(settings)
    if isinstance(preflight, int):
        return preflight
    urls, pepper = preflight
    worker: WorkerLaunch | None = None
    context: WorkerContext | None = None
    clickhouse: ClickHouse | None = None
    if args.worker_run_dir:  # one worker of `ibex proxy --workers N` (see runtime/workers.py)
        ready_fd, lifeline_fd = (int(fd) for fd in args.worker_fds.split(","))
        worker = WorkerLaunch(args.port, Path(args.worker_run_dir), ready_fd, lifeline_fd)
        context = WorkerContext.read(worker.run_dir)
        if context.engine is not None:
            clickhouse = ClickHouse(urls.clickhouse_url, engine=context.engine)
    try:
        stores = await Stores.open(urls, settings, clickhouse=clickhouse)
        try:
            app = create_app(settings, stores, pepper=pepper, metrics_dir=context.metrics_dir if context else None)
            await _serve_app(app, args.host, args.port, "proxy", worker)
            return 0
        finally:
            await stores.close()
    finally:
        if clickhouse is not None:
            await clickhouse.close()


def _proxy_workers(args: argparse.Namespace, settings: Settings) -> int:
    """``--workers``, else ``IBEX_PROXY_WORKERS``; 0 (the default) is one per usable CPU."""
    workers: int = settings.proxy_workers if args.workers is None else args.workers
    return workers or usable_cpus()


def cmd_proxy(args: argparse.Namespace, settings: Settings) -> int:
    """The proxy stage alone: one process with ``--workers 1``, else a supervisor and its workers."""
    workers = _proxy_workers(args, settings)
    if workers == 1 or args.worker_run_dir:
        return _run_stage("proxy", args, settings, _serve_proxy)
    if args.data_dir:
        settings = settings.model_copy(update={"data_dir": Path(args.data_dir)})
    try:
        preflight = _proxy_preflight(settings)
    except EmbeddedStoreError as e:
        print(f"ibex proxy: {e}", file=sys.stderr)
        return 1
    if isinstance(preflight, int):
        return preflight
    urls, _ = preflight
    data_dir = ["--data-dir", args.data_dir] if args.data_dir else []

    def command(launch: WorkerLaunch) -> list[str]:
        return [
            sys.executable, "-m", "ibex_dataplane.cli", "proxy", "--workers", "1", *data_dir, "--host", args.host,
            "--port", str(launch.port), "--worker-run-dir", str(launch.run_dir),
            "--worker-fds", f"{launch.ready_fd},{launch.lifeline_fd}",
        ]  # fmt: skip

    engine_url = urls.clickhouse_url if urls.clickhouse_url.startswith("chdb:") else None
    return supervise(workers, args.host, args.port, command, engine_url=engine_url)


async def _serve_memory(args: argparse.Namespace, settings: Settings) -> int:
    from ibex_dataplane.embedding.onnx import OnnxMiniLMEmbedder
    from ibex_dataplane.pii.redactor import PiiRedactor

    if settings.internal_secret is None:
        print("ibex memory: IBEX_INTERNAL_SECRET is required (the proxy signs principals with it)", file=sys.stderr)
        return 2
    secret = settings.internal_secret.get_secret_value().encode()
    stores = await Stores.open(StoreUrls.from_settings(settings), settings)
    embedder = await asyncio.to_thread(OnnxMiniLMEmbedder.from_installed_packages, settings.memory_embedding_precision)
    redactor = await asyncio.to_thread(
        PiiRedactor, threshold=settings.pii_threshold, enable_ner=settings.pii_enable_ner
    )
    try:
        app = create_memory_app(settings, stores, embedder=embedder, redactor=redactor, secret=secret)
        port = settings.memory_port if args.port is None else args.port
        await _serve_app(app, args.host or settings.memory_host, port, "memory")
        return 0
    finally:
        redactor.close()
        embedder.close()
        await stores.close()


def cmd_memory(args: argparse.Namespace, settings: Settings) -> int:
    """The memory stage alone (reachable only with principals signed with IBEX_INTERNAL_SECRET)."""
    return _run_stage("memory", args, settings, _serve_memory)


def _providers_problem(settings: Settings, *, keys: bool) -> str | None:
    """What is wrong with ``IBEX_PROVIDERS_FILE``, if anything: checked before a process opens anything, so a
    missing key variable or a malformed entry stops it at once with a message saying what to fix. ``keys``: also
    resolve the provider API keys (the proxy calls providers; the context stage only reads the catalog)."""
    path = settings.providers_file
    if path is None:
        return None
    try:
        config = load_provider_config(path, resolve_keys=keys)
        catalog = ModelCatalog.from_config(config)
        if keys:
            ProviderRegistry.check_config(config, catalog)
    except CatalogConfigError as e:
        return f"invalid providers file (IBEX_PROVIDERS_FILE={path}): {e}"
    return None


def _port_problem(host: str, port: int) -> str | None:
    """Why the proxy could not listen on ``host:port``, checked before anything starts (the bind is tried and
    released; aiohttp binds the same way, with SO_REUSEADDR)."""
    if port == 0:
        return None
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as e:
        return (
            f"cannot listen on {host}:{port} ({e.strerror or type(e).__name__}): stop what uses that port, or pass"
            " --port P (--port 0 picks a free one)"
        )
    return None


def _catalog(settings: Settings) -> ModelCatalog:
    return catalog_for(
        settings.providers_file,
        echo_input_price=settings.echo_input_price_per_mtok,
        echo_output_price=settings.echo_output_price_per_mtok,
    )


async def _serve_context(args: argparse.Namespace, settings: Settings) -> int:
    if settings.internal_secret is None:
        print("ibex context: IBEX_INTERNAL_SECRET is required (the proxy signs principals with it)", file=sys.stderr)
        return 2
    stage = ContextStage(
        settings, catalog=_catalog(settings), memory_url=settings.memory_url,
        secret=settings.internal_secret.get_secret_value().encode(), host=args.host or settings.context_host,
        port=settings.context_port if args.port is None else args.port,
        health_port=settings.context_health_port if args.health_port is None else args.health_port,
    )  # fmt: skip
    await stage.start()
    stage.metrics.heap.freeze()
    try:
        print(f"ibex context ready: grpc://{stage.address} (health {stage.health_url})", flush=True)
        await _wait_for_signal()
        return 0
    finally:
        await stage.stop()


def cmd_context(args: argparse.Namespace, settings: Settings) -> int:
    """The context stage alone (gRPC; reachable only with principals signed with IBEX_INTERNAL_SECRET)."""
    return _run_stage("context", args, settings, _serve_context)


async def _issue_key(args: argparse.Namespace, settings: Settings) -> int:
    from ibex_operator.models import ApiKeySpec
    from ibex_operator.reconcile import Reconciler
    from ibex_operator.repository import TenantConfigRepository
    from ibex_operator.secrets import FileSecretSink

    urls = StoreUrls.from_settings(settings)
    pepper = (
        settings.key_pepper.get_secret_value().encode()
        if settings.key_pepper
        else load_or_create_secret(settings.data_dir / "pepper")
    )
    name = args.name or f"{args.agent}-cli-{secrets.token_hex(3)}"
    spec = ApiKeySpec.model_validate(
        {
            "organizationRef": {"name": args.org},
            "agentRefs": [{"name": a} for a in args.agent.split(",")],
            "scopes": args.scopes.split(","),
            "secretName": name,
        }
    )
    stores = await Stores.open(urls, settings, admin=True)
    try:
        assert stores.admin_pool is not None
        sink = FileSecretSink(settings.data_dir / "secrets.json")
        reconciler = Reconciler(TenantConfigRepository(stores.admin_pool, stores.redis), sink, pepper)
        outcome = await reconciler.api_key(args.namespace, name, spec, generation=1)
        if not outcome.ready:
            print(f"ibex keys issue: {outcome.reason}: {outcome.message}", file=sys.stderr)
            return 1
        token = await sink.read(args.namespace, name)
    finally:
        await stores.close()
    print(json.dumps({"name": f"{args.namespace}/{name}", "key_id": outcome.fields["keyId"], "token": token}))
    return 0


def cmd_keys_issue(args: argparse.Namespace, settings: Settings) -> int:
    """Issue an API key locally (the plaintext is printed once; only its hash is stored)."""
    if args.data_dir:
        settings = settings.model_copy(update={"data_dir": Path(args.data_dir)})
    try:
        return asyncio.run(_issue_key(args, settings))
    except (StoreError, EmbeddedStoreError) as e:
        print(f"ibex keys issue: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"ibex keys issue: invalid key: {e}", file=sys.stderr)
        return 2


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    try:
        urls = StoreUrls.from_settings(settings)
    except EmbeddedStoreError as e:
        print(f"ibex migrate: {e}", file=sys.stderr)
        return 1
    holder = _engine_holder(settings, urls)
    if holder is not None:
        print(
            f"ibex migrate: {_who(holder)} runs the embedded stores of {settings.data_dir} and applied every pending"
            " migration when it started (its ClickHouse engine opens in one process only, so nothing else can"
            " migrate it). To apply migrations added since, stop `ibex dev` and start it again: it migrates at"
            " every start. `ibex migrate` is for stores you run yourself (the IBEX_* store URLs).",
            file=sys.stderr,
        )
        return 2

    async def run() -> None:
        clickhouse = ClickHouse(urls.clickhouse_url)
        try:
            await migrate_all(urls, settings, clickhouse)
        finally:
            await clickhouse.close()

    try:
        asyncio.run(run())
    except (StoreError, EmbeddedStoreError) as e:
        print(f"ibex migrate: {e}", file=sys.stderr)
        return 1
    print("migrations applied")
    return 0


def cmd_wait_schema(args: argparse.Namespace, settings: Settings) -> int:
    """Wait until the Postgres schema has every migration this build ships (the chart's data-plane init
    container: on a first install the operator's leader is still applying them). Applies nothing."""
    try:
        dsn = StoreUrls.from_settings(settings).postgres_app_dsn
        count = asyncio.run(wait_for_postgres_schema(dsn, migrations_dir(settings) / "postgres", timeout=args.timeout))
    except (StoreError, EmbeddedStoreError) as e:
        print(f"ibex wait-schema: {e}", file=sys.stderr)
        return 1
    print(f"schema ready: {count} Postgres migrations applied", flush=True)
    return 0


def cmd_operator(args: argparse.Namespace, settings: Settings) -> int:
    # Imported here: the data plane never imports the operator at module level (the CLI is the composition root).
    from ibex_operator.app import main as operator_main
    from ibex_operator.lease import LeaseTiming
    from ibex_operator.options import OperatorOptions

    if args.data_dir:
        settings = settings.model_copy(update={"data_dir": Path(args.data_dir)})
    duration = args.lease_duration
    try:
        options = OperatorOptions(
            namespaces=tuple(args.namespace or ()),
            kubeconfig=Path(args.kubeconfig) if args.kubeconfig else None,
            lease_name=args.lease_name,
            lease_namespace=args.lease_namespace or os.environ.get("POD_NAMESPACE") or None,
            identity=args.identity or os.environ.get("POD_NAME") or "",
            lease=LeaseTiming(duration, duration * 2 / 3, max(0.2, duration / 7.5)),
            resync_interval=args.resync_interval,
            retry_max=args.retry_max,
            health_host=args.health_host,
            health_port=args.health_port,
            migrate=args.migrate,
        )
    except ValueError as e:
        print(f"ibex operator: {e}", file=sys.stderr)
        return 2
    return operator_main(options, settings)


CAPTURE_DRAINED_SQL = (
    "SELECT (SELECT count(*) FROM session_checkpoints WHERE org_id = $1) >= $2"
    " AND NOT EXISTS (SELECT 1 FROM capture_jobs WHERE org_id = $1)"
)


async def _eval_locomo(args: argparse.Namespace, settings: Settings, runtime: EmbeddedRuntime) -> int:
    from ibex_dataplane.evaluation.dataset import load_locomo
    from ibex_dataplane.evaluation.locomo import Agent, default_progress, evaluate, render_table
    from ibex_operator.models import AgentSpec, ApiKeySpec, OrganizationSpec
    from ibex_operator.reconcile import Reconciler
    from ibex_operator.repository import TenantConfigRepository
    from ibex_operator.secrets import FileSecretSink

    conversations = load_locomo(Path(args.file))
    stores = await _migrated_stores(runtime, settings)
    try:
        assert stores.admin_pool is not None
        pepper = secrets.token_bytes(32)
        sink = FileSecretSink(runtime.data_dir / "secrets.json")
        reconciler = Reconciler(TenantConfigRepository(stores.admin_pool, stores.redis), sink, pepper)

        capture = args.capture == "turns"

        async def provision(name: str) -> Agent:
            """A fresh organization, one agent and a memory key for it, through the real reconcile code."""
            slug = "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")[:40] or "conversation"
            org_spec = OrganizationSpec.model_validate({"models": {"default": "echo"}} if capture else {})
            org = await reconciler.organization("eval", slug, org_spec, generation=1)
            memory = {"memory": {"capture": "turns"}} if capture else {}
            agent_spec = AgentSpec.model_validate({"organizationRef": {"name": slug}, **memory})
            agent = await reconciler.agent("eval", f"{slug}-agent", agent_spec, generation=1)
            key_spec = ApiKeySpec.model_validate(
                {
                    "organizationRef": {"name": slug},
                    "agentRefs": [{"name": f"{slug}-agent"}],
                    "scopes": ["chat", "memory:read", "memory:write"] if capture else ["memory:read", "memory:write"],
                    "secretName": f"{slug}-key",
                }
            )
            key = await reconciler.api_key("eval", f"{slug}-key", key_spec, generation=1)
            token = await sink.read("eval", f"{slug}-key")
            if not (org.ready and agent.ready and key.ready and token):
                raise EmbeddedStoreError(f"cannot provision an agent for {name}: {org.reason} {agent.reason}")
            org_id = uuid.UUID(org.fields["orgId"])

            async def drained(turns: int) -> bool:
                """Every chat turn was checkpointed (with it, its capture job queued: after the answer) and nothing
                of this org is left in the capture queue (processed jobs are deleted)."""
                assert stores.admin_pool is not None
                async with stores.admin_pool.acquire() as conn:
                    done: bool = await conn.fetchval(CAPTURE_DRAINED_SQL, org_id, turns)
                    return done

            return Agent(agent.fields["agentId"], token, drained if capture else None)

        async with _data_plane(settings, stores, pepper, "127.0.0.1", 0) as base_url:
            report = await evaluate(
                conversations, base_url, provision, ks=args.k, categories=args.categories,
                progress=default_progress(), capture=capture,
            )  # fmt: skip
    finally:
        await stores.close()
    print(json.dumps(report.to_json()) if args.json else render_table(report), flush=True)
    return 0


def cmd_eval_locomo(args: argparse.Namespace, settings: Settings) -> int:
    """Evidence recall of the public memory search on a LoCoMo-format file, on fresh embedded stores."""
    import tempfile

    from ibex_dataplane.evaluation.dataset import DatasetError
    from ibex_dataplane.evaluation.locomo import EvaluationError

    if max(args.k) > 50:
        print("ibex eval locomo: --k is at most 50 (the search route's largest limit)", file=sys.stderr)
        return 2
    # The stages' per-request logs would bury the progress bar; warnings still show.
    logging.getLogger("ibex_dataplane").setLevel(max(logging.WARNING, logging.getLogger().level))
    with tempfile.TemporaryDirectory(prefix="ibex-eval-") as tmp:
        runtime = EmbeddedRuntime(Path(tmp))
        try:
            runtime.start()
            import uvloop

            return uvloop.run(_eval_locomo(args, settings, runtime))
        except DatasetError as e:
            print(f"ibex eval locomo: {e}", file=sys.stderr)
            return 2
        except (StoreError, EmbeddedStoreError, EvaluationError) as e:
            print(f"ibex eval locomo: {e}", file=sys.stderr)
            return 1
        finally:
            with contextlib.suppress(Exception):
                runtime.stop()


def cmd_mcp(args: argparse.Namespace, settings: Settings) -> int:
    from ibex_dataplane.mcp_bridge import run_bridge

    try:
        token = Path(args.key_file).read_text().strip()
    except OSError as e:
        print(f"ibex mcp: cannot read the key file {args.key_file}: {e.strerror}", file=sys.stderr)
        return 2
    if not token:
        print(f"ibex mcp: the key file {args.key_file} is empty (it must hold the API key alone)", file=sys.stderr)
        return 2
    return asyncio.run(run_bridge(args.url, token, args.agent))


def cmd_usage(args: argparse.Namespace, settings: Settings) -> int:
    from ibex_dataplane.usage_cli import run_usage

    try:
        token = Path(args.key_file).read_text().strip()
    except OSError as e:
        print(f"ibex usage: cannot read the key file {args.key_file}: {e.strerror}", file=sys.stderr)
        return 2
    if not token:
        print(f"ibex usage: the key file {args.key_file} is empty (it must hold the API key alone)", file=sys.stderr)
        return 2
    params = {"group_by": args.group_by}
    for name in ("from", "to"):
        value = getattr(args, f"{name}_date")
        if value:
            params[name] = value
    code, text = run_usage(args.url, token, params, args.json)
    print(text, file=sys.stdout if code == 0 else sys.stderr)
    return code


def _count(value: str) -> int:
    try:
        count = int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from e
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value!r}")
    return count


def _int_list(value: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from e
    if not items or any(i < 1 for i in items):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return items


def _commands(parser: argparse.ArgumentParser, dest: str) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """Subcommands whose list is the parser's epilog (one line each, see :func:`_list_commands`), not argparse's."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser.add_subparsers(dest=dest, required=True, metavar="COMMAND", help=argparse.SUPPRESS)


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str
) -> argparse.ArgumentParser:
    """A subcommand whose one-line summary is its description (shown by ``ibex --help`` and ``ibex NAME --help``)."""
    return sub.add_parser(name, description=summary)


def leaf_commands(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """Every runnable command under ``parser`` (``dev``, ``keys issue``, ...) with its one-line summary."""
    found: list[tuple[str, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                nested = leaf_commands(child)
                found += [(f"{name} {n}", s) for n, s in nested] if nested else [(name, child.description or "")]
    return found


def _list_commands(parser: argparse.ArgumentParser) -> None:
    """Give every parser with subcommands an epilog listing them, one line each."""
    commands = leaf_commands(parser)
    if not commands:
        return
    width = max(len(name) for name, _ in commands)
    lines = [f"  {name:<{width}}  {summary}" for name, summary in commands]
    parser.epilog = "commands (add --help after one for its flags):\n" + "\n".join(lines)
    parser.usage = "%(prog)s [-h] COMMAND ..."  # set last: the subcommands' own prog was derived without it
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _list_commands(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ibex",
        description="IBEX Harness: memory and gateway layer for agents",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = _commands(parser, "command")

    dev = _command(sub, "dev", "run the whole stack locally on embedded stores")
    dev.add_argument("--manifests", default="examples/tenants", help="folder of tenant YAML manifests")
    dev.add_argument("--data-dir", default=None, help="where embedded stores keep data (IBEX_DATA_DIR)")
    dev.add_argument("--host", default=None, help="proxy listen address (IBEX_HOST)")
    dev.add_argument("--port", type=int, default=None, help="proxy port, 0 for a free one (IBEX_PORT)")
    dev.add_argument("--keys-out", default=None, help="write issued API keys here as JSON (default DATA_DIR/keys.json)")
    dev.set_defaults(func=cmd_dev)

    proxy = _command(sub, "proxy", "run the proxy stage against configured (or `ibex dev`'s) stores")
    proxy.add_argument("--data-dir", default=None, help="attach to the stores of `ibex dev` running on this data dir")
    proxy.add_argument("--host", default=None, help="listen address (IBEX_HOST)")
    proxy.add_argument("--port", type=int, default=None, help="port, 0 for a free one (IBEX_PORT)")
    proxy.add_argument(
        "--workers", type=_count, default=None,
        help="worker processes sharing the port; 0: one per usable CPU (IBEX_PROXY_WORKERS, default 0)",
    )  # fmt: skip
    # Set by the supervisor of `--workers N` on each worker's command line (see runtime/workers.py).
    proxy.add_argument("--worker-run-dir", default=None, help=argparse.SUPPRESS)
    proxy.add_argument("--worker-fds", default=None, help=argparse.SUPPRESS)
    proxy.set_defaults(func=cmd_proxy)

    memory = _command(sub, "memory", "run the memory stage against configured (or `ibex dev`'s) stores")
    memory.add_argument("--data-dir", default=None, help="attach to the stores of `ibex dev` running on this data dir")
    memory.add_argument("--host", default=None, help="listen address (IBEX_MEMORY_HOST)")
    memory.add_argument("--port", type=int, default=None, help="port, 0 for a free one (IBEX_MEMORY_PORT)")
    memory.set_defaults(func=cmd_memory)
    context = _command(sub, "context", "run the context stage (gRPC ContextAssembly) against the memory stage")
    context.add_argument("--host", default=None, help="listen address (IBEX_CONTEXT_HOST)")
    context.add_argument("--port", type=int, default=None, help="gRPC port, 0 for a free one (IBEX_CONTEXT_PORT)")
    context.add_argument(
        "--health-port", type=int, default=None, help="port of /healthz, /readyz, /metrics (IBEX_CONTEXT_HEALTH_PORT)"
    )
    context.set_defaults(func=cmd_context)

    keys = _commands(_command(sub, "keys", "API keys"), "keys_command")
    issue = _command(keys, "issue", "issue a key for agents of an organization (local stores)")
    issue.add_argument("--org", required=True, help="Organization name")
    issue.add_argument("--agent", required=True, help="Agent name (comma-separated for several)")
    issue.add_argument("--namespace", default="tenants", help="namespace of the organization (default: tenants)")
    issue.add_argument("--scopes", default="chat,memory:read,memory:write,memory:delete", help="comma-separated")
    issue.add_argument("--name", default=None, help="ApiKey name (default: generated)")
    issue.add_argument("--data-dir", default=None, help="the data dir of a running `ibex dev`")
    issue.set_defaults(func=cmd_keys_issue)

    evaluation = _commands(_command(sub, "eval", "measure retrieval quality"), "eval_command")
    locomo = _command(evaluation, "locomo", "evidence recall@k of memory search on a LoCoMo-format file")
    locomo.add_argument("file", help="LoCoMo-format JSON (a list of conversations with questions)")
    locomo.add_argument("--k", type=_int_list, default=[1, 5, 10, 20], help="cut-offs (default: 1,5,10,20; max 50)")
    locomo.add_argument("--categories", type=_int_list, default=[1, 2, 3, 4], help="question categories (1,2,3,4)")
    locomo.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    locomo.add_argument(
        "--capture", choices=["off", "turns"], default="off",
        help="off: write turns through /v1/memories:batch; turns: replay them as chats of an agent with"
        " memory.capture: turns and let the capture worker write them",
    )  # fmt: skip
    locomo.set_defaults(func=cmd_eval_locomo)

    migrate = _command(sub, "migrate", "apply pending Postgres and ClickHouse migrations")
    migrate.set_defaults(func=cmd_migrate)

    wait_schema = _command(sub, "wait-schema", "wait until the Postgres migrations are applied (applies none)")
    wait_schema.add_argument(
        "--timeout", type=float, default=600.0, help="give up (exit 1) after this many seconds (default: 600)"
    )
    wait_schema.set_defaults(func=cmd_wait_schema)

    mcp = _command(sub, "mcp", "MCP over stdio for a local client, forwarded to a proxy's /mcp")
    mcp.add_argument("--url", required=True, help="the proxy's base URL, e.g. http://127.0.0.1:8080")
    mcp.add_argument("--key-file", required=True, help="file holding the API key alone")
    mcp.add_argument("--agent", required=True, help="the agent to act as (its id, or its name)")
    mcp.set_defaults(func=cmd_mcp)

    usage = _command(sub, "usage", "print an organization's spend and tokens (GET /v1/usage) as a table")
    usage.add_argument("--url", required=True, help="the proxy's base URL, e.g. http://127.0.0.1:8080")
    usage.add_argument("--key-file", required=True, help="file holding an API key with the usage:read scope")
    usage.add_argument("--group-by", choices=("agent", "model", "day"), default="agent", help="rows (default: agent)")
    usage.add_argument("--from", dest="from_date", default=None, help="first day, YYYY-MM-DD (default: this month)")
    usage.add_argument("--to", dest="to_date", default=None, help="day after the last, YYYY-MM-DD (default: tomorrow)")
    usage.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    usage.set_defaults(func=cmd_usage)

    op = _command(sub, "operator", "run the Kubernetes operator (Organization, Agent, Directive, ApiKey)")
    op.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG"),
        help="kubeconfig file (default: KUBECONFIG, else the in-cluster service account, else ~/.kube/config)",
    )
    op.add_argument(
        "--namespace", action="append", help="watch only this namespace or glob (repeatable; default: all namespaces)"
    )
    op.add_argument("--data-dir", default=None, help="attach to the embedded stores of `ibex dev` (runtime.json)")
    op.add_argument("--identity", default=None, help="leader-election identity (default: POD_NAME, else unique)")
    op.add_argument("--lease-name", default="ibex-operator", help="name of the leader-election Lease")
    op.add_argument("--lease-namespace", default=None, help="namespace of the Lease (default: POD_NAMESPACE)")
    op.add_argument("--lease-duration", type=float, default=15.0, help="seconds before a silent leader is replaced")
    op.add_argument("--resync-interval", type=float, default=300.0, help="seconds between periodic reconciles")
    op.add_argument("--retry-max", type=float, default=60.0, help="longest backoff for Ready=False resources (s)")
    op.add_argument("--health-host", default="127.0.0.1", help="address of /healthz, /readyz and /metrics")
    op.add_argument("--health-port", type=int, default=None, help="port of the health endpoint (default: off)")
    op.add_argument("--migrate", action="store_true", help="apply pending migrations once this replica leads")
    op.set_defaults(func=cmd_operator)
    _list_commands(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings()
    except ValueError as e:
        print(f"ibex: invalid configuration: {e}", file=sys.stderr)
        return 2
    if args.command in ("dev", "proxy", "context", "eval"):
        problem = _providers_problem(settings, keys=args.command != "context")
        if problem is not None:
            print(f"ibex {args.command}: {problem}", file=sys.stderr)
            return 2
    if args.command in ("dev", "proxy"):  # the proxy's listener; other stages default to their own settings
        args.host = settings.host if args.host is None else args.host
        args.port = settings.port if args.port is None else args.port
        # A worker of `ibex proxy --workers N` is not probed: its supervisor holds the port, and a sibling may be
        # listening on it already (SO_REUSEPORT), which a plain probe would take for another program.
        worker = args.command == "proxy" and args.worker_run_dir
        problem = None if worker else _port_problem(args.host, args.port)
        if problem is not None:
            print(f"ibex {args.command}: {problem}", file=sys.stderr)
            return 2
    _configure_logging(settings)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result: int = args.func(args, settings)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
