"""``--etcd etcd://HOST:PORT[,...]``: whether an etcd cluster answers there,
each endpoint's version, member and leader, and whether they agree on one.
"""

from __future__ import annotations

import time

from ._record import JSON, Findings, Problem

ETCD_TIMEOUT = 2.0
"""How long ``--etcd`` waits for each endpoint to answer (seconds)."""


def etcd_check(text: str) -> JSON:
    """Each endpoint of the etcd address ``text``: its status (one request to
    its JSON gateway, :data:`ETCD_TIMEOUT` at most), or why it gave none;
    and the cluster's verdict: healthy when every endpoint that answered
    names one leader, and more than half of those listed answered."""
    from .._etcd import Etcd, parse_etcd_addr

    addr = parse_etcd_addr(text, "--etcd")
    client = Etcd(addr.endpoints, ETCD_TIMEOUT)
    started = time.monotonic()
    endpoints: list[JSON] = []
    for host, port in addr.endpoints:
        entry: JSON = {"endpoint": f"{host}:{port}", "answered": False, "detail": ""}
        try:
            status = client.status(host, port, ETCD_TIMEOUT)
        except Exception as exc:
            entry["detail"] = f"{type(exc).__name__}: {exc}"
        else:
            entry.update(
                answered=True,
                version=status.get("version", ""),
                member=str(status.get("header", {}).get("member_id", "")),
                leader=str(status.get("leader", "0")),
                db_size=int(status.get("dbSize", 0)),
            )
            entry["detail"] = f"etcd {entry['version']}, leader {entry['leader']}"
        endpoints.append(entry)
    answered = [e for e in endpoints if e["answered"]]
    leaders = {e["leader"] for e in answered}
    leader = next(iter(leaders)) if len(leaders) == 1 and "0" not in leaders else None
    healthy = leader is not None and 2 * len(answered) > len(endpoints)
    if healthy:
        verdict = f"healthy: {len(answered)} of {len(endpoints)} answered, leader {leader}"
    elif not answered:
        verdict = "no endpoint answered"
    elif leader is None:
        verdict = f"no leader all agree on ({', '.join(sorted(leaders))})"
    else:
        verdict = f"only {len(answered)} of {len(endpoints)} answered: no majority of those listed"
    return {
        "addr": text,
        "prefix": addr.prefix,
        "endpoints": endpoints,
        "leader": leader,
        "healthy": healthy,
        "detail": verdict,
        "seconds": round(time.monotonic() - started, 4),
    }


def advise_etcd(ec: JSON, found: Findings) -> None:
    """Add to ``found`` what :func:`etcd_check` found: a cluster that is not
    healthy is a problem."""
    if not ec["healthy"]:
        silent = [e["endpoint"] for e in ec["endpoints"] if not e["answered"]]
        found.problems.append(
            Problem(
                f"the etcd cluster at {ec['addr']} is not healthy: {ec['detail']}",
                (f"start etcd on {', '.join(silent)}, or " if silent else "")
                + "check etcdctl endpoint status --cluster; a cluster needs a majority of "
                "its members up to elect a leader",
            )
        )
