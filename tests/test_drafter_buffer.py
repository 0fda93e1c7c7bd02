"""Drafter data path: windows cut from FeatureSequences, the bounded version-tagged buffer
(newest first, previous step's long sequences as fallback, held-out split), packing with segment
ids and the shifted pairs that never cross a segment (hand-computed)."""

from __future__ import annotations

import numpy as np
import torch

from tlt.services.drafter.buffer import FeatureBuffer, windows
from tlt.services.drafter.packing import PackedBatch, Sample, pack, packed_pairs
from tlt.v1 import events_pb2


def fseq(seq_id: str, n: int, version: int, h: int = 4, response_start: int = 1) -> events_pb2.FeatureSequence:
    feats = (np.arange(n * h, dtype=np.float32).reshape(n, h) / 100).astype(np.float16)
    return events_pb2.FeatureSequence(seq_id=seq_id, token_ids=list(range(100, 100 + n)), response_start=response_start,
                                      hidden_size=h, features=feats.tobytes(), policy_version=version)


def sample(seq_id: str, n: int, version: int = 0, rs: int = 0, h: int = 2) -> Sample:
    return Sample(seq_id, np.arange(1, n + 1, dtype=np.int32), np.ones((n, h), np.float16) * len(seq_id),
                  rs, version)


def test_windows_overlap_by_one_and_start_at_the_response() -> None:
    seq = fseq("a", 10, 3, response_start=4)  # prompt 0..3; h_3 predicts the first response token
    ws = windows(seq, 4)
    assert [w.tokens.tolist() for w in ws] == [[103, 104, 105, 106], [106, 107, 108, 109]]
    assert ws[0].response_start == 1 and ws[1].response_start == 0
    assert all(w.policy_version == 3 for w in ws)
    assert ws[1].features[0].tolist() == seq_features(seq)[6].tolist()


def seq_features(seq: events_pb2.FeatureSequence) -> np.ndarray:
    return np.frombuffer(seq.features, np.float16).reshape(len(seq.token_ids), seq.hidden_size)


def test_bad_feature_size_is_rejected_and_counted() -> None:
    buf = FeatureBuffer(10, 10, 8, 4, holdout_every=100)
    bad = fseq("b", 5, 0)
    bad.hidden_size = 3
    assert buf.add_batch(events_pb2.FeatureBatch(sequences=[bad, fseq("ok", 5, 0)])) == 1
    assert buf.rejected == 1


def test_pack_and_pairs_by_hand() -> None:
    a = Sample("a", np.array([1, 2, 3], np.int32), np.arange(6, dtype=np.float16).reshape(3, 2), 0, 5)
    b = Sample("b", np.array([7, 8], np.int32), np.arange(10, 14, dtype=np.float16).reshape(2, 2), 0, 6)
    batch, used = pack([a, b], rows=1, row_tokens=6)
    assert [s.seq_id for s in used] == ["a", "b"] and batch.policy_version == 6
    assert batch.tokens.tolist() == [[1, 2, 3, 7, 8]]
    assert batch.segment_ids.tolist() == [[0, 0, 0, 1, 1]]
    p = packed_pairs(batch.tokens, batch.features, batch.segment_ids, batch.loss_mask)
    assert p.input_ids.tolist() == [[2, 3, 7, 8]]
    assert p.positions.tolist() == [[1, 2, 3, 1]]  # the crossing pair stays in a; b restarts at 1
    assert p.mask.tolist() == [[True, True, False, True]]  # pair (7, h_a2) crosses a -> b: never trained
    assert p.features[0, 2].tolist() == [4.0, 5.0] and p.target[0, 3].tolist() == [12.0, 13.0]
    again = PackedBatch.from_proto(batch.to_proto())
    assert torch.equal(again.features, batch.features) and torch.equal(again.segment_ids, batch.segment_ids)


def test_pack_respects_rows_and_pads() -> None:
    batch, used = pack([sample("x", 5), sample("yy", 4), sample("zzz", 3)], rows=2, row_tokens=6)
    assert len(used) == 2  # x in row 0, yy in row 1; zzz fits nowhere
    assert batch.segment_ids.tolist() == [[0, 0, 0, 0, 0], [1, 1, 1, 1, -1]]
    assert not batch.loss_mask[1, 4]


def test_response_mask() -> None:
    s = Sample("m", np.arange(6, dtype=np.int32), np.zeros((6, 2), np.float16), 3, 0)
    assert s.loss_mask().tolist() == [False, False, True, True, True, True]


def test_buffer_newest_first_then_previous_long_and_bounded() -> None:
    buf = FeatureBuffer(max_sequences=5, max_holdout=2, window_tokens=50, long_tokens=6, holdout_every=1000)
    buf.add_samples([sample("old", 20, version=0)])
    buf.add_samples([sample("p_short", 4, version=1), sample("p_long", 8, version=1)])
    buf.add_samples([sample("n1", 3, version=2), sample("n2", 3, version=2)])
    batch = buf.batch(rows=1, row_tokens=100)
    # newest (v2) first, then v1's long sequence; v1 short and v0 never
    assert batch.sequences == 3 and batch.tokens.shape[1] == 3 + 3 + 8
    assert batch.segment_ids[0, -1] == 2
    buf.add_samples([sample(f"f{i}", 3, version=3) for i in range(4)])
    assert buf.stats()[0] == 5  # bounded: oldest evicted
    assert buf.versions() == [3, 2]


def test_holdout_split_every_k() -> None:
    buf = FeatureBuffer(100, 100, 64, 4, holdout_every=3)
    buf.add_batch(events_pb2.FeatureBatch(sequences=[fseq(f"s{i}", 6, 1) for i in range(9)]))
    assert len(buf.holdout(1)) == 3 and buf.stats()[0] == 6


def test_fallback_keeps_every_window_of_a_long_previous_sequence() -> None:
    """"Long" is the sequence's length, not the window's: the last (short) window of a long previous-step
    sequence is fallback data too, and a short sequence is not, whatever the window size."""
    buf = FeatureBuffer(max_sequences=50, max_holdout=5, window_tokens=6, long_tokens=6, holdout_every=1000)
    buf.add_batch(events_pb2.FeatureBatch(sequences=[fseq("long", 10, 1), fseq("short", 5, 1)]))
    assert [len(s) for s in buf._train] == [6, 5, 5]  # long@0 (6), long@5 (5), short@0 (5)
    buf.add_samples([sample("n", 3, version=2, h=4)])
    batch = buf.batch(rows=1, row_tokens=100)
    assert batch.sequences == 3 and batch.tokens.shape[1] == 3 + 6 + 5  # v2, then both windows of "long"


def test_pack_skips_one_token_samples_they_have_no_pair() -> None:
    # a one-token window has no (x_{j+1}, h_j) pair: packing it would only waste row space
    batch, used = pack([sample("one", 1)], rows=1, row_tokens=8)
    assert batch is None and used == []
    batch, used = pack([sample("one", 1), sample("two", 2)], rows=1, row_tokens=8)
    assert [s.seq_id for s in used] == ["two"] and batch.sequences == 1
    assert batch.segment_ids.tolist() == [[0, 0]]


def test_pack_places_a_sample_that_exactly_fills_a_row() -> None:
    batch, used = pack([sample("a", 4)], rows=1, row_tokens=4)
    assert [s.seq_id for s in used] == ["a"] and batch.tokens.tolist() == [[1, 2, 3, 4]]
    # the second sample fills row 0's last 3 slots exactly: first fit puts it there, not in row 1
    batch, used = pack([sample("a", 3), sample("b", 3)], rows=2, row_tokens=6)
    assert batch.segment_ids.tolist() == [[0, 0, 0, 1, 1, 1], [-1, -1, -1, -1, -1, -1]]


def test_pair_positions_restart_at_one_in_every_segment() -> None:
    # row: a (2 tokens) then b (4 tokens): segments [0, 0, 1, 1, 1, 1]; pairs j = 0..4 sit at
    # j - start(segment of h_j) + 1: a's pair at 1, the crossing pair at 2 (still a's), then b's pairs at 1, 2, 3
    batch, _ = pack([sample("a", 2), sample("bb", 4)], rows=1, row_tokens=6)
    p = packed_pairs(batch.tokens, batch.features, batch.segment_ids, batch.loss_mask)
    assert p.positions.tolist() == [[1, 2, 1, 2, 3]]
    assert p.mask.tolist() == [[True, False, True, True, True]]


def test_pack_carries_each_samples_response_mask() -> None:
    # h_t is a target from t = response_start - 1: sample c (rs 3) masks t = 0, 1; sample d (rs 1) none
    c = Sample("c", np.arange(5, dtype=np.int32), np.zeros((5, 2), np.float16), 3, 0)
    d = Sample("d", np.arange(3, dtype=np.int32), np.zeros((3, 2), np.float16), 1, 0)
    batch, _ = pack([c, d], rows=1, row_tokens=8)
    assert batch.loss_mask.tolist() == [[False, False, True, True, True, True, True, True]]
    p = packed_pairs(batch.tokens, batch.features, batch.segment_ids, batch.loss_mask)
    # pair j trains target h_{j+1}: c's pairs 0..3 -> targets h_1..h_4 = [F, T, T, T]; pair 4 crosses c -> d
    assert p.mask.tolist() == [[False, True, True, True, False, True, True]]


def test_holdout_is_the_newest_version_then_older_ones_newest_first_until_min_tokens() -> None:
    buf = FeatureBuffer(10, 10, 64, 4, holdout_every=1)
    buf.add_samples([sample("v1", 5, version=1), sample("v3a", 3, version=3), sample("v2", 4, version=2),
                     sample("v3b", 3, version=3)], holdout=True)
    assert [s.seq_id for s in buf.holdout(6)] == ["v3a", "v3b"]  # the newest hold exactly 6 tokens: enough
    assert [s.seq_id for s in buf.holdout(7)] == ["v3a", "v3b", "v2"]  # 6 < 7: the next newest version
    assert [s.seq_id for s in buf.holdout(11)] == ["v3a", "v3b", "v2", "v1"]  # 10 < 11: and the next
    assert [s.seq_id for s in buf.holdout(100)] == ["v3a", "v3b", "v2", "v1"]  # no more to add


def test_sender_drops_are_each_senders_running_count_not_a_sum_of_reports() -> None:
    # dropped_before is the sender's count so far: replica 0 reports 3, then 5, then a late 4 (its latest count
    # is 5), replica 1 reports 2 -> 5 + 2 = 7 dropped in all
    buf = FeatureBuffer(10, 10, 8, 4, holdout_every=100)

    def report(replica: int, dropped: int) -> events_pb2.FeatureBatch:
        s = fseq(f"r{replica}d{dropped}", 3, 0)
        s.replica_id = replica
        return events_pb2.FeatureBatch(sequences=[s], dropped_before=dropped)

    for replica, dropped in ((0, 3), (0, 5), (1, 2), (0, 4)):
        buf.add_batch(report(replica, dropped))
    assert buf.sender_dropped == 7 and buf.received_sequences == 4


def test_a_previous_version_sequence_of_exactly_long_tokens_is_fallback_data() -> None:
    buf = FeatureBuffer(max_sequences=10, max_holdout=2, window_tokens=50, long_tokens=6, holdout_every=1000)
    buf.add_samples([sample("p6", 6, version=1), sample("p5", 5, version=1), sample("n", 3, version=2)])
    batch = buf.batch(rows=1, row_tokens=100)
    assert batch.sequences == 2 and batch.tokens.shape[1] == 3 + 6  # v2, then v1's 6 tokens (6 >= 6); not 5


def test_drops_are_summed_over_trainer_ranks_and_over_a_restarted_replica() -> None:
    # Every trainer rank has its own pusher and tags its sequences replica -1; a restarted rollout replica has a
    # new pusher whose count starts again at 0. Keyed by replica id, the drafter took the max and hid drops.
    import torch

    from tlt.services.common.events_local import LocalFeatureQueue
    from tlt.services.drafter.trainer_hook import push_trainer_features

    buf = FeatureBuffer(100, 100, 16, 4, holdout_every=1000, hidden_size=4)
    for drops in (3, 5):  # two ranks
        rank = LocalFeatureQueue(maxsize=1)
        push = lambda q=rank: push_trainer_features(q, [[1, 2, 3, 4]], [torch.randn(4, 4)], [2], 1)  # noqa: E731
        assert push()
        for _ in range(drops):
            assert not push()  # the queue is full: dropped and counted by this rank's pusher
        buf.add_batch(rank.recv(0.1))
        assert push()  # carries this rank's count
        buf.add_batch(rank.recv(0.1))
    assert buf.sender_dropped == 8
    for life, drops in ((0, 10), (1, 4)):  # replica 0 before and after a restart: two pushers
        s = fseq(f"life{life}", 3, 0, h=4)
        buf.add_batch(events_pb2.FeatureBatch(sequences=[s], dropped_before=drops, sender=f"replica0-life{life}"))
    assert buf.sender_dropped == 8 + 14


def test_holdout_takes_whole_groups_so_no_sibling_of_a_held_out_sequence_is_trained_on() -> None:
    # every k-th SEQUENCE went to the held-out set: the other samples of its prompt trained the candidate, which then
    # looked better on the gate's held-out set than on new prompts
    buf = FeatureBuffer(100, 100, 64, 4, holdout_every=3)
    seqs = []
    for g in range(6):
        for k in range(4):
            s = fseq(f"g{g}/{k}", 6, 1)
            s.group_id = f"g{g}"
            seqs.append(s)
    buf.add_batch(events_pb2.FeatureBatch(sequences=seqs[::2]))  # samples of one prompt arrive in several batches
    buf.add_batch(events_pb2.FeatureBatch(sequences=seqs[1::2]))
    held = {s.seq_id.split("/")[0] for s in buf.holdout(1000)}
    trained = {s.seq_id.split("/")[0] for s in buf._train}
    assert held == {"g2", "g5"} and not held & trained and len(buf.holdout(1000)) == 8


def test_the_trainers_features_carry_their_prompt_group() -> None:
    # the trainer tagged every sequence as its own group: the held-out split could not keep a prompt's samples together
    import torch

    from tlt.services.common.events_local import LocalFeatureQueue
    from tlt.services.drafter.trainer_hook import push_trainer_features

    q = LocalFeatureQueue()
    assert push_trainer_features(q, [[1, 2, 3], [1, 2, 4], [5, 6, 7]], [torch.randn(3, 4)] * 3, [2, 2, 2], 3,
                                 groups=["p0", "p0", "p1"])
    assert [s.group_id for s in q.recv(0.1).sequences] == ["trainer-3-p0", "trainer-3-p0", "trainer-3-p1"]


def test_the_trainers_features_start_at_the_prompts_last_token_and_keep_max_tokens() -> None:
    """A sequence goes to the drafter from its prompt's last token, for at most max_tokens tokens, with those
    tokens' hidden rows and its response start counted from there (push_trainer_features: the prompt's last token
    kept); a cut from the sequence's start, or from the response's first token, passed before."""
    from tlt.services.common.events_local import LocalFeatureQueue
    from tlt.services.drafter.trainer_hook import push_trainer_features

    q = LocalFeatureQueue()
    hidden = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    assert push_trainer_features(q, [list(range(10, 20)), [7, 8]], [hidden, hidden[:2]], [3, 0], 1, max_tokens=4)
    long, short = q.recv(0.1).sequences
    assert list(long.token_ids) == [12, 13, 14, 15] and long.response_start == 1
    rows = np.frombuffer(long.features, dtype=np.float16).reshape(-1, 4)
    assert rows.tolist() == hidden[2:6].tolist()
    assert list(short.token_ids) == [7, 8] and short.response_start == 0  # no prompt: from its first token


def test_a_sample_longer_than_a_row_trains_on_its_first_row_tokens_with_their_own_features_and_mask() -> None:
    # a 6-token window (response from t = 2) packed into rows of 4: tokens, features and mask are all t = 0..3 (its
    # tail, or the tail's features beside the head's tokens, would pair h_t with another token)
    s = Sample("long", np.arange(10, 16, dtype=np.int32), np.arange(12, dtype=np.float16).reshape(6, 2), 3, 0)
    batch, used = pack([s], rows=1, row_tokens=4)
    assert [u.seq_id for u in used] == ["long"]
    assert batch.tokens.tolist() == [[10, 11, 12, 13]]
    assert batch.features[0].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert batch.loss_mask.tolist() == [[False, False, True, True]]


def test_pack_keeps_placing_while_a_row_has_room_for_a_two_token_sample() -> None:
    # after "a" the row has 2 free slots: a 2-token sample still fits there and is placed (packing stops only when
    # every row has at most one slot left, the room of no pair)
    batch, used = pack([sample("a", 4), sample("b", 2)], rows=1, row_tokens=6)
    assert [s.seq_id for s in used] == ["a", "b"] and batch.sequences == 2
    assert batch.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1]]
    # a window that does not fit is passed over, not the end of packing: the 2-token one after it still goes in
    batch, used = pack([sample("a", 4), sample("big", 4), sample("c", 2)], rows=1, row_tokens=6)
    assert [s.seq_id for s in used] == ["a", "c"]


def test_a_packed_batch_comes_back_from_the_wire_field_for_field() -> None:
    # what a worker trains on is the coordinator's batch: the prompt tokens' False in the loss mask, the batch's
    # policy version and its sequence count all survive to_proto / from_proto
    c = Sample("c", np.arange(5, dtype=np.int32), np.arange(10, dtype=np.float16).reshape(5, 2), 3, 4)
    d = Sample("d", np.arange(3, dtype=np.int32), np.ones((3, 2), np.float16), 1, 7)
    batch, _ = pack([c, d], rows=3, row_tokens=5)  # 3 rows, 2 sequences: the counts differ
    again = PackedBatch.from_proto(batch.to_proto())
    assert again.loss_mask.tolist() == batch.loss_mask.tolist() == [[False, False, True, True, True],
                                                                    [True, True, True, False, False], [False] * 5]
    for name in ("tokens", "features", "segment_ids"):
        assert torch.equal(getattr(again, name), getattr(batch, name)), name
    assert (again.policy_version, again.sequences) == (batch.policy_version, batch.sequences) == (7, 2)
