"""Rank 0's text of a batch (exokv.rank.textflow): one message in flight, the rest joined,
and the decode held when the front end falls more than a window of steps behind."""

from __future__ import annotations

import threading

from exokv.rank.textflow import TextFlow
from exokv.wire.messages import Texts


def flow(window: int = 3) -> tuple[TextFlow, list[Texts]]:
    sent: list[Texts] = []
    return TextFlow(sent.append, window=window), sent


def test_pieces_wait_for_the_message_in_flight_and_travel_together() -> None:
    text, sent = flow()
    text.add(7, "a")
    text.step()
    assert sent == [Texts(step=1, pieces=[[7, "a"]])]
    text.add(7, "b")
    text.add(9, "x")
    text.step()
    text.add(7, "c")
    text.step()
    assert len(sent) == 1  # step 1's message is not seen yet: steps 2 and 3 wait
    text.seen(1)
    text.step()  # step 4: nothing new, but steps 2-3 go now that nothing is in flight
    assert sent[1] == Texts(step=4, pieces=[[7, "bc"], [9, "x"]])


def test_a_step_with_no_text_sends_nothing() -> None:
    text, sent = flow()
    text.add(1, "")
    text.step()
    text.flush()
    assert sent == []


def test_flush_sends_what_is_pending_even_with_a_message_in_flight() -> None:
    text, sent = flow()
    text.add(1, "a")
    text.step()
    text.add(1, "b")
    text.step()
    text.flush()
    assert [m.pieces for m in sent] == [[[1, "a"]], [[1, "b"]]]


def run_steps(text: TextFlow, n: int) -> threading.Event:
    done = threading.Event()

    def steps() -> None:
        for _ in range(n):
            text.add(1, "t")
            text.step()
        done.set()

    threading.Thread(target=steps, daemon=True).start()
    return done


def test_the_decode_waits_when_the_front_end_is_a_window_behind() -> None:
    text, sent = flow(window=3)
    done = run_steps(text, 5)  # step 1 is sent; steps 2-4 are within the window; 5 is not
    assert not done.wait(0.5)
    assert len(sent) == 1
    text.seen(1)
    assert done.wait(10)
    assert [m.step for m in sent] == [1, 5]


def test_a_front_end_that_went_away_is_not_waited_for() -> None:
    text, sent = flow(window=1)
    done = run_steps(text, 10)
    assert not done.wait(0.3)
    text.gone()
    assert done.wait(10)
