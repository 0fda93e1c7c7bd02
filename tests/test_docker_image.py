"""The image docker-compose.yml runs (deploy/Dockerfile), read against the compose file: what the build context
leaves out and which folders the image gives its user. Read statically: no Docker engine on the machine this was
written on. Split out of tests/test_compose.py."""

from __future__ import annotations

from test_compose import BASE_ENV, ROOT, interpolate, raw  # noqa: F401 - raw: the compose file fixture


def test_host_folders_mounted_at_run_time_stay_out_of_the_image(raw):
    """./data (DATA_DIR's default) is bind-mounted into the trainer; in the build context it would be sent to
    the builder and copied into the image by `COPY . .` (a Parquet data set: gigabytes per build)."""
    ignored = {line.strip().strip("/") for line in (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    doc = interpolate(raw, BASE_ENV)
    for name, svc in doc["services"].items():
        for m in svc["volumes"]:
            source = m["source"] if isinstance(m, dict) else m.split(":")[0]
            if source.startswith("./"):
                assert source[2:].strip("/") in ignored, f"{name} mounts {source}: add it to deploy/Dockerfile.dockerignore"


def test_every_named_volume_is_mounted_on_a_folder_the_image_gives_its_user(raw):
    """A new, empty named volume takes the owner of the image's folder at its mount point; one the image lacks is
    root's. /run/tlt was missing: the token job (the image's non-root user) could not write its token, and with
    it failing, no service that depends on it would start. (Read from the Dockerfile: no Docker engine here.)"""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    made = {p for line in dockerfile.splitlines() if "mkdir -p" in line
            for p in line.split("mkdir -p", 1)[1].split("&&")[0].split()}
    owned = {p for line in dockerfile.splitlines() if "chown -R tlt:tlt" in line
             for p in line.split("chown -R tlt:tlt", 1)[1].split("&&")[0].split()}
    doc = interpolate(raw, BASE_ENV)
    for name, svc in doc["services"].items():
        for m in svc["volumes"]:
            source, target = (m["source"], m["target"]) if isinstance(m, dict) else m.split(":")[:2]
            if source in doc["volumes"]:  # a named volume, not a bind mount
                assert target in made and target in owned, f"{name}: {target} is not made and owned by tlt"
