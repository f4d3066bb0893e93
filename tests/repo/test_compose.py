"""docker-compose.yml cannot run here (no Docker engine); prove what can be proven: it
parses, every command and path it names exists in the repo, and host ports do not clash
and listen on loopback only."""

from __future__ import annotations

from pathlib import Path

import yaml

from shardless.processor.cli import parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_the_stack_has_emulators_a_cluster_a_producer_and_the_job():
    assert {
        "moto",
        "kinesis",
        "spark-master",
        "spark-worker-1",
        "spark-worker-2",
        "producer",
        "job",
        "localstack",
    } <= set(SERVICES)


def test_built_images_name_a_dockerfile_whose_copied_paths_exist():
    for name, svc in SERVICES.items():
        if "build" in svc:
            dockerfile = ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]
            assert dockerfile.is_file(), name
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY "):
                    for src in line.split()[1:-1]:
                        assert (ROOT / src).exists(), f"{dockerfile}: COPY {src}"


def test_shardless_commands_parse_and_their_files_exist():
    for name in ("producer", "job"):
        command = SERVICES[name]["command"]
        assert command[0] == "shardless"
        args = parser().parse_args(command[1:])
        if hasattr(args, "app_file"):
            assert (ROOT / args.app_file).is_file()


def test_workers_have_one_core_each_and_reach_the_master():
    for name in ("spark-worker-1", "spark-worker-2"):
        command = SERVICES[name]["command"]
        assert command[command.index("--cores") + 1] == "1"
        assert "spark://spark-master:7077" in command
    assert "spark://spark-master:7077" in SERVICES["job"]["command"]


def published(svc: dict) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each published port ("" for any
    address), in the short syntax `[ip:]host:container` or the long one."""
    out = []
    for p in svc.get("ports", []):
        if isinstance(p, dict):
            out.append((p.get("host_ip", ""), str(p.get("published", "")), str(p["target"])))
            continue
        parts = str(p).rsplit(":", 2)
        if len(parts) == 1:  # a container port alone: Docker picks a host port on every address
            out.append(("", "", parts[0]))
        else:
            out.append(("" if len(parts) == 2 else parts[0], parts[-2], parts[-1]))
    return out


def test_host_ports_do_not_clash():
    host_ports = [port for svc in SERVICES.values() for _, port, _ in published(svc)]
    assert len(host_ports) == len(set(host_ports))


def test_published_ports_listen_on_loopback_only():
    """The Spark master (7077) takes jobs from anyone who reaches it and moto takes any
    credentials: nothing is published on all interfaces."""
    for name, svc in SERVICES.items():
        for host_ip, port, target in published(svc):
            assert host_ip in ("127.0.0.1", "[::1]"), (
                f"{name} publishes {target} on all interfaces (as host port {port or 'any'}): "
                f"write it 127.0.0.1:{port or target}:{target}"
            )


def test_the_port_parser_sees_every_form():
    svc = {"ports": ["5000:5000", "127.0.0.1:7077:7077", "8080", {"target": 1, "published": 2}]}
    assert published(svc) == [
        ("", "5000", "5000"),
        ("127.0.0.1", "7077", "7077"),
        ("", "", "8080"),
        ("", "2", "1"),
    ]


def test_the_job_talks_only_to_the_emulators_in_the_stack():
    env = SERVICES["job"]["environment"]
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_DYNAMODB", "AWS_ENDPOINT_URL_KINESIS"):
        host = env[var].split("//")[1].split(":")[0]
        assert host in SERVICES


def test_localstack_is_an_opt_in_profile_that_demands_its_token():
    svc = SERVICES["localstack"]
    assert svc["profiles"] == ["localstack"]
    assert "LOCALSTACK_AUTH_TOKEN:?" in svc["environment"]["LOCALSTACK_AUTH_TOKEN"]
    assert all("profiles" not in s for n, s in SERVICES.items() if n != "localstack")
