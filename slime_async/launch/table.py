"""The launch table of `slime-async run`: which roles a config needs, their command lines, probes.

    stages = plan_roles(cfg, run_dir)     # [[buffer, engine0..], [router], [generator0.., learner]]

Each child gets the run's config.json plus the overrides of its role on the command line, so the
command line in logs/supervisor.log reruns it by hand. Ports that are 0 in the config are chosen
here (free now on 127.0.0.1); on --resume they are chosen afresh.

| role        | command                                              | ready when                       |
| ----------- | ---------------------------------------------------- | -------------------------------- |
| buffer      | slime_async buffer                                   | ports open, stats round-trip     |
| engine<i>   | slime_async engine, engine.port=P_i (+ the learner's | GET /health is 200               |
|             | reserve where it shares its GPU: gpu_memory.py)      |                                  |
| router      | smg or sglang-router (num_engines > 1 only)          | GET /workers: all is_healthy     |
| generator<i>| slime_async generator, engine.urls=[router or engine]| ready file (announce_ready)      |
| learner     | slime_async learner (torchrun if learner_procs > 1)  | ready file (announce_ready)      |

engine.kind == "external" starts no engines and no router: generator and learner use engine.urls.

On a Ray cluster (`slime_async/launch/ray/`) the same table is planned with `RoleAddresses`: each
address is the node the role was placed on (buffer endpoints, engine URLs, the router, the
learner's rank 0 for torch.distributed and the weight group), each port one found free there;
engines may run `run.ray.engine_command` (e.g. SGLang) instead of the embedded engine, and the
learner's ranks are started one process each with the torch.distributed environment set
(`RoleSpec.rank_envs`) instead of under torchrun: the same `python -m slime_async learner`.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from slime_async.config import BufferConfig, ConfigError, SlimeConfig
from slime_async.launch.router import http_ok, router_argv, router_ready
from slime_async.launch.run_dir import RunDir
from slime_async.launch.supervisor import RoleSpec, ready_file_exists
from slime_async.queue.client import ConsumerClient
from slime_async.utils.procs import free_port, python_module, tcp_ready

LOOPBACK = "127.0.0.1"


@dataclass
class RoleAddresses:
    """Where the roles listen when they run on other nodes (filled in by the Ray launcher from
    the node each role was placed on; ports found free on that node)."""

    buffer_host: str
    """Node of the buffer: its producer and consumer endpoints bind there."""
    buffer_ports: tuple[int, int]
    """Producer and consumer ports."""
    engines: list[tuple[str, int]]
    """(node, port) of each engine, in order."""
    router: tuple[str, int, int] | None
    """(node, port, prometheus port) of the sglang-router; None without one."""
    learner_master: tuple[str, int]
    """(node of rank 0, port) of the learner's torch.distributed rendezvous (MASTER_ADDR/PORT)."""


def engine_command_argv(template: list[str], **fields: object) -> list[str]:
    """`run.ray.engine_command` with its {fields} filled in; an unknown field names itself."""
    try:
        return [part.format(**fields) for part in template]
    except KeyError as e:
        raise ConfigError(
            f"run.ray.engine_command: unknown field {{{e.args[0]}}}; known: "
            + ", ".join(f"{{{k}}}" for k in sorted(fields))
        ) from None


def _arg(key: str, value: object) -> str:
    """A `key=value` override whose value reads back as the same TOML value."""
    return f"{key}={json.dumps(value)}"


def _endpoint_ready(endpoint: str) -> bool:
    if endpoint.startswith("ipc://"):
        return Path(endpoint.removeprefix("ipc://")).exists()
    parsed = urlparse(endpoint)
    return tcp_ready(parsed.hostname or LOOPBACK, parsed.port or 0)


def buffer_ready(cfg: BufferConfig) -> bool:
    """Both endpoints accept connections and the buffer answers a stats request."""
    if not (_endpoint_ready(cfg.producer_endpoint) and _endpoint_ready(cfg.consumer_endpoint)):
        return False
    client = ConsumerClient(cfg, consumer_id="supervisor-probe")
    try:
        return isinstance(client.stats(), dict)
    finally:
        client.close()


def _with_free_port(endpoint: str) -> str:
    """tcp://host:0 -> tcp://host:<a free port>; anything else unchanged."""
    parsed = urlparse(endpoint)
    if parsed.scheme == "tcp" and parsed.port == 0:
        host = parsed.hostname or LOOPBACK
        return f"tcp://{host}:{free_port(host)}"
    return endpoint


def _loopback_only(urls: list[str]) -> bool:
    hosts = {urlparse(u).hostname or "" for u in urls}
    return bool(hosts) and all(h == "localhost" or h.startswith("127.") for h in hosts)


def _nonempty_dir(save_dir: Path) -> Path | None:
    return save_dir if save_dir.is_dir() and any(save_dir.iterdir()) else None


def plan_roles(
    cfg: SlimeConfig,
    run_dir: RunDir,
    where: RoleAddresses | None = None,
    gpu_reserve: dict[int, float] | None = None,
) -> list[list[RoleSpec]]:
    """The launch table for `cfg`, in start stages; the config file the children read is
    `run_dir.config_json` (written by the caller, with run.run_dir set). `where`: the roles'
    nodes and ports on a cluster (Ray); None: this machine, free ports on loopback.
    `gpu_reserve`: engine index -> GiB that engine keeps free for the learner on their shared
    GPU (`gpu_memory.gpu_shares`)."""
    gpu_reserve = gpu_reserve or {}
    if cfg.run.run_dir is None or Path(cfg.run.run_dir).resolve() != run_dir.path:
        raise ConfigError(f"run.run_dir must be the run's directory {run_dir.path} before planning")
    config = str(run_dir.config_json)
    py = sys.executable

    # buffer -------------------------------------------------------------------------------
    if where is None:
        endpoints = {
            "producer_endpoint": _with_free_port(cfg.buffer.producer_endpoint),
            "consumer_endpoint": _with_free_port(cfg.buffer.consumer_endpoint),
        }
    else:
        host, (pport, cport) = where.buffer_host, where.buffer_ports
        endpoints = {
            "producer_endpoint": f"tcp://{host}:{pport}",
            "consumer_endpoint": f"tcp://{host}:{cport}",
        }
    buf = cfg.buffer.model_copy(update=endpoints)
    buffer_args = [
        _arg("buffer.producer_endpoint", buf.producer_endpoint),
        _arg("buffer.consumer_endpoint", buf.consumer_endpoint),
    ]
    paths = cfg.paths()  # cfg.run.run_dir is this run's directory
    if paths.wal_dir is not None:  # the WAL is what lets --resume lose nothing
        buffer_args.append(_arg("buffer.wal_dir", str(paths.wal_dir)))
    first = [
        RoleSpec(
            name="buffer",
            argv=lambda resume: python_module("slime_async", "buffer", config, *buffer_args),
            ready=lambda _path: buffer_ready(buf),
            ready_what=f"stats from {buf.consumer_endpoint}",
        )
    ]

    # engines and router ------------------------------------------------------------------------
    stages: list[list[RoleSpec]] = [first]
    eng = cfg.engine
    router_url: str | None = None
    if eng.kind == "embedded":
        if where is None:
            hosts = [eng.host] * eng.num_engines
            ports = [
                free_port(eng.host) if eng.port == 0 else eng.port + i
                for i in range(eng.num_engines)
            ]
        else:
            hosts = [h for h, _ in where.engines]
            ports = [p for _, p in where.engines]
        engine_urls = [f"http://{h}:{p}" for h, p in zip(hosts, ports, strict=True)]
        model_args = []
        if eng.model_path is None and cfg.learner.model_path is not None:
            model_args = [_arg("engine.model_path", cfg.learner.model_path)]
        # An engine on a learner's GPU keeps the learner's estimated peak free (gpu_memory.py).
        reserve = {
            i: _arg("engine.embedded.gpu_reserve_gib", gib) for i, gib in gpu_reserve.items()
        }
        for i, (port, url) in enumerate(zip(ports, engine_urls, strict=True)):
            template = cfg.run.ray.engine_command if where is not None else []
            if template:
                argv = engine_command_argv(
                    template,
                    python=py,
                    config=config,
                    host=hosts[i],
                    port=port,
                    gpus=cfg.run.ray.gpus_per_engine,
                    index=i,
                    seed=eng.seed + i,
                    model_path=eng.model_path or cfg.learner.model_path or "",
                )
            else:
                host_args = [] if where is None else [_arg("engine.host", hosts[i])]
                argv = python_module(
                    "slime_async",
                    "engine",
                    config,
                    _arg("engine.port", port),
                    *host_args,
                    *model_args,
                    *([reserve[i]] if i in reserve else []),
                    # Each engine its own sampler stream (run.seed seeds the first).
                    _arg("engine.seed", eng.seed + i),
                )
            devices = cfg.run.engine_cuda_devices
            first.append(
                RoleSpec(
                    name=f"engine{i}",
                    argv=lambda resume, argv=argv: argv,
                    env={"CUDA_VISIBLE_DEVICES": devices[i]} if i < len(devices) else {},
                    ready=lambda _path, url=url: http_ok(f"{url}/health", eng.api_key),
                    ready_what=f"GET {url}/health",
                    liveness_url=url,
                )
            )
        if eng.num_engines > 1:
            if where is None or where.router is None:
                rhost = LOOPBACK
                rport = free_port(LOOPBACK) if eng.router_port == 0 else eng.router_port
                prom = free_port(LOOPBACK)
            else:
                rhost, rport, prom = where.router
            router_url = f"http://{rhost}:{rport}"
            # The router stops sending requests to a hung engine about when the roles report it.
            interval = max(1, math.ceil(eng.liveness.probe_interval_s))
            argv = router_argv(
                engine_urls,
                host=rhost,
                port=rport,
                prometheus_port=prom,
                policy=eng.router_policy,
                api_key=eng.api_key,
                health_check=(interval, max(1, math.ceil(eng.liveness.hung_after_s / interval))),
                package=eng.router_package,
            )
            stages.append(
                [
                    RoleSpec(
                        name="router",
                        argv=lambda resume, argv=argv: argv,
                        ready=lambda _path: router_ready(router_url, engine_urls, eng.api_key),
                        ready_what=f"GET {router_url}/workers lists {len(engine_urls)} healthy",
                    )
                ]
            )
    else:
        if not eng.urls:
            raise ConfigError("engine.urls: engine.kind = 'external' needs the engines' URLs")
        engine_urls = list(eng.urls)
        router_url = eng.router_url

    # generators and learner --------------------------------------------------------------------
    last: list[RoleSpec] = []
    n_gen = cfg.run.num_generators
    for i in range(n_gen):
        gen_args = [
            _arg("buffer.producer_endpoint", buf.producer_endpoint),
            _arg("engine.urls", engine_urls),
        ]
        if router_url is not None:  # generation goes through the router, weights do not
            gen_args.append(_arg("engine.router_url", router_url))
        if n_gen > 1:  # each takes its own shard of the prompts and its own sequence numbers
            gen_args += [
                _arg("generator.producer_id", f"gen{i}"),
                _arg("generator.num_shards", n_gen),
                _arg("generator.shard_index", i),
            ]
        last.append(
            RoleSpec(
                name=f"generator{i}",
                # The generator keeps its cursor under the run dir (generator.state_path) and
                # resumes from it by itself.
                argv=lambda resume, a=gen_args: python_module(
                    "slime_async", "generator", config, *a
                ),
                ready=ready_file_exists,
                ready_what="ready file",
                on_exit_0="expected",
            )
        )

    save_dir = paths.checkpoints or run_dir.checkpoints_dir  # never None with a run directory
    learner_args = [
        _arg("buffer.consumer_endpoint", buf.consumer_endpoint),
        _arg("engine.urls", engine_urls),  # weights go to each engine, never through the router
        _arg("learner.save", str(save_dir)),
    ]
    if cfg.push.master_addr is None and where is not None:
        # The weight group's store is hosted by rank 0: its node, as the engines reach it.
        learner_args.append(_arg("push.master_addr", where.learner_master[0]))
    elif cfg.push.master_addr is None and _loopback_only(engine_urls):
        # Every engine is on this machine's loopback: so is the weight group's store (the
        # default, this node's routable address, is for engines on other nodes).
        learner_args.append(_arg("push.master_addr", LOOPBACK))

    def learner_argv(resume: bool) -> list[str]:
        args = list(learner_args)
        ckpt = _nonempty_dir(save_dir) if resume else None
        if ckpt is not None:
            args.append(_arg("learner.load", str(ckpt)))
        if cfg.run.learner_procs > 1 and where is None:
            launcher = [
                py,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(cfg.run.learner_procs),
                "-m",
                "slime_async",
            ]
        else:
            launcher = python_module("slime_async")
        return [*launcher, "learner", config, *args]

    learner_env = {}
    if cfg.run.learner_cuda_devices is not None:
        learner_env["CUDA_VISIBLE_DEVICES"] = cfg.run.learner_cuda_devices
    rank_envs: list[dict[str, str]] = []
    if where is not None:  # one process per rank, as torchrun would set them up
        master, master_port = where.learner_master
        n = cfg.run.learner_procs
        rank_envs = [
            {
                "MASTER_ADDR": master,
                "MASTER_PORT": str(master_port),
                "RANK": str(r),
                "WORLD_SIZE": str(n),
                # Each rank's bundle makes its one GPU the only visible one: device 0.
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
            }
            for r in range(n)
        ]
    last.append(
        RoleSpec(
            name="learner",
            argv=learner_argv,
            env=learner_env,
            rank_envs=rank_envs,
            ready=ready_file_exists,
            ready_what="ready file",
            on_exit_0="ends_run",
        )
    )
    stages.append(last)
    return stages
