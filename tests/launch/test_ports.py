import random
import socket
from pathlib import Path

from rljob.launch.ports import LOWEST_PORT, ephemeral_start, pick_ports


def range_file(tmp_path: Path, low: int, high: int = 60999) -> Path:
    path = tmp_path / "ip_local_port_range"
    path.write_text(f"{low}\t{high}\n")
    return path


def test_ports_are_distinct_and_drawn_below_the_kernels_range_for_outgoing_connections(tmp_path):
    ranges = range_file(tmp_path, 32768)
    ports = pick_ports(40, host="127.0.0.1", range_file=ranges)
    assert len(set(ports)) == 40
    assert all(LOWEST_PORT <= p < 32768 for p in ports)


def test_a_wanted_port_is_kept_while_free_and_replaced_once_something_listens_on_it(tmp_path):
    ranges = range_file(tmp_path, 32768)
    [port] = pick_ports(1, host="127.0.0.1", range_file=ranges)
    assert pick_ports(1, host="127.0.0.1", wanted=[port], range_file=ranges) == [port]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        [fresh] = pick_ports(1, host="127.0.0.1", wanted=[port], range_file=ranges)
    assert fresh != port and LOWEST_PORT <= fresh < 32768


def test_a_port_taken_by_a_draw_is_skipped(tmp_path):
    ranges = range_file(tmp_path, 32768)
    seeded = random.Random(7)
    first = seeded.randrange(LOWEST_PORT, 32768)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        taken.listen(1)
        [port] = pick_ports(1, host="127.0.0.1", rng=random.Random(7), range_file=ranges)
    assert port != first


def test_with_no_room_below_the_range_the_kernel_chooses(tmp_path):
    ranges = range_file(tmp_path, LOWEST_PORT + 2)
    ports = pick_ports(3, host="127.0.0.1", range_file=ranges)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)


def test_an_unreadable_range_falls_back_to_linuxs_default(tmp_path):
    assert ephemeral_start(tmp_path / "missing") == 32768
    assert ephemeral_start(range_file(tmp_path, 40000)) == 40000
