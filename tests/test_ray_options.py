"""specdeploy on Ray Serve: the deployment's options against Ray's own validation, the application
builder's arguments from a config file, which cluster `serve --replicas` starts or joins, and where it
says it serves. The tests that need a cluster reuse test_ray's."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import warnings

import httpx
import pytest

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]' in the specdeploy clone)")
from ray import serve  # noqa: E402

from specdeploy.errors import SpecdeployError  # noqa: E402
from specdeploy.ray import RayConfig, app_builder, deployment  # noqa: E402
from specdeploy.serve import ServeConfig  # noqa: E402
from test_ray import BUNDLE, RAY_WAIT_S, cluster, free_port, stop_process  # noqa: E402,F401  (cluster: the fixture)

pytestmark = pytest.mark.ray


def test_max_queue_zero_is_served_or_refused_with_its_own_error():
    """`serve --max-queue 0` is a valid single-process setting (no request waits); on Ray it became
    max_queued_requests=0, which Ray's DeploymentConfig refuses with a pydantic ValidationError
    ('error: ValidationError: 1 validation error for DeploymentConfig' from the CLI)."""
    try:
        deployment(ServeConfig(bundle=BUNDLE, max_queue=0), RayConfig(replicas=1, threads_per_replica=1))
    except SpecdeployError:
        pass  # a clear refusal naming --max-queue would do too


def test_autoscaling_settings_pass_rays_validation_without_warnings():
    """look_back_period_s must exceed Ray's metrics interval (10 s): 5 s gets a FutureWarning that says
    it will raise an exception in a future release."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deployment(ServeConfig(bundle=BUNDLE), RayConfig(replicas=1, min_replicas=1, max_replicas=2,
                                                         threads_per_replica=1))


def test_without_ray_address_serve_starts_a_local_cluster_even_with_RAY_ADDRESS_set(monkeypatch):
    """Without --ray-address a local cluster is started (docs/scaling.md). ray.init(address=None) joins
    the cluster in $RAY_ADDRESS (or one `ray start` left on this machine) instead, and then refuses the
    num_cpus it is given: 'error: ValueError: When connecting to an existing cluster, num_cpus ...'."""
    from ray._private.services import canonicalize_bootstrap_address

    from specdeploy import ray as specdeploy_ray

    calls = []

    class Stop(Exception):
        pass

    def fake_init(*args, **kwargs):
        calls.append(kwargs)
        raise Stop

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(Stop):
        specdeploy_ray.serve_on_ray(ServeConfig(bundle=BUNDLE, host="127.0.0.1", port=0),
                                    RayConfig(replicas=1, threads_per_replica=1))
    address = calls[0].get("address")
    # ray.init itself reads $RAY_ADDRESS when address is None or "auto"
    assert address not in (None, "auto") and canonicalize_bootstrap_address(address) is None, address


def test_with_ray_address_and_serve_already_running_the_log_names_the_clusters_proxy(cluster):
    """--ray-address joins a cluster whose Ray Serve already runs (its proxy on the cluster fixture's
    port): serve.start's http_options are then ignored by Ray ('New http_options ... will not be
    applied'). `specdeploy serve` logged --host/--port as its URL, where nothing listens; it names the
    cluster's proxy, where the application answers. On exit only specdeploy's application is deleted:
    the cluster and its Serve keep running."""
    address = ray.get_runtime_context().gcs_address
    port = free_port()
    command = [sys.executable, "-m", "specdeploy", "serve", BUNDLE, "--replicas", "1", "--threads-per-replica", "1",
               "--host", "127.0.0.1", "--port", str(port), "--ray-address", address]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr] + [lines.put("")], daemon=True).start()
    seen = []
    try:
        line = ""
        while "on Ray Serve" not in line:
            line = lines.get(timeout=RAY_WAIT_S)
            seen.append(line)
            assert line, "the server exited before serving: " + "".join(seen[-5:])
        assert "the cluster's own Ray Serve proxy" in line and f":{port}" not in line, line
        health = httpx.get(cluster + "/health", timeout=30)  # where the cluster's proxy answers
        assert health.status_code == 200, health.text
    finally:
        stop_process(process)
    assert ray.is_initialized() and serve.status() is not None  # the joined cluster and its Serve outlive it


def test_joining_a_cluster_that_runs_an_application_of_our_name_is_refused():
    """--ray-address: our application is named 'specdeploy'. One already on the cluster would have been replaced
    by serve.run, and deleted on exit. A local cluster is new: nothing of ours runs there."""
    from ray.serve.schema import ServeStatus

    from specdeploy.ray import serve_already_running

    ours = ServeStatus(applications={"specdeploy": {}})
    with pytest.raises(SpecdeployError, match="already runs on this cluster"):
        serve_already_running(ours, local=False)
    assert serve_already_running(ServeStatus(), local=False) is False


@pytest.mark.parametrize("line", ["api_key: 12345", "api_key: 012345", "api_key: 0x1F", "model_name: 3.10"])
def test_a_yaml_number_for_a_text_field_is_refused_asking_for_quotes(line):
    """A config file's unquoted `api_key: 012345` reaches app_builder as a number (5349: YAML 1.1 reads octal).
    It crashed check_config ('int' object has no attribute 'strip'); text made from the number would be another
    key than the file shows, so every client would get 401. One error asks for quotes."""
    yaml = pytest.importorskip("yaml")
    field, value = next(iter(yaml.safe_load(line).items()))
    assert not isinstance(value, str)
    with pytest.raises(SpecdeployError, match="write it in quotes"):
        app_builder({"bundle": BUNDLE, field: value})
