from services.frontend.router import LoadRouter, RouteRequest, WorkerLoad


def req(n_tokens: int) -> RouteRequest:
    return RouteRequest("r", list(range(n_tokens)))


def test_decode_fewest_requests_then_most_free_blocks() -> None:
    r = LoadRouter(local_prefill_threshold=4)
    busy = WorkerLoad("a:1", running=3, free_blocks=200, total_blocks=256)
    idle_small = WorkerLoad("b:1", running=0, free_blocks=10, total_blocks=256)
    idle_big = WorkerLoad("c:1", running=0, free_blocks=100, total_blocks=256)
    assert r.route(req(1), [busy, idle_small, idle_big], []).decode == "c:1"  # type: ignore[union-attr]


def test_inflight_counts_between_load_reports() -> None:
    a = WorkerLoad("a:1", running=0, free_blocks=100, total_blocks=256, inflight=2)
    b = WorkerLoad("b:1", running=1, free_blocks=90, total_blocks=256)
    assert LoadRouter().pick_decode([a, b]) == b


def test_full_decode_workers_go_last() -> None:
    full = WorkerLoad("a:1", running=0, free_blocks=0, total_blocks=256)
    busy = WorkerLoad("b:1", running=9, free_blocks=5, total_blocks=256)
    assert LoadRouter().pick_decode([full, busy]) == busy


def test_no_decode_worker_no_route() -> None:
    assert LoadRouter().route(req(100), [], [WorkerLoad("p:1")]) is None


def test_prefill_threshold_and_least_queued() -> None:
    r = LoadRouter(local_prefill_threshold=8)
    d = [WorkerLoad("d:1")]
    p = [WorkerLoad("p:1", queued_prompt_tokens=500), WorkerLoad("p:2", queued_prompt_tokens=20),
         WorkerLoad("p:3", queued_prompt_tokens=0, inflight_prompt_tokens=300)]
    assert r.route(req(7), d, p).prefill == ""  # type: ignore[union-attr]
    assert r.route(req(8), d, p).prefill == "p:2"  # type: ignore[union-attr]
    assert r.route(req(8), d, []).prefill == ""  # type: ignore[union-attr]


def test_ties_break_on_address_so_choice_is_deterministic() -> None:
    ws = [WorkerLoad("b:1", free_blocks=5), WorkerLoad("a:1", free_blocks=5)]
    assert LoadRouter().pick_decode(ws).address == "a:1"  # type: ignore[union-attr]
