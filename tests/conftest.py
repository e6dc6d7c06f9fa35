"""Make the book tools (tools/*.py, plain scripts) importable by the tests."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

# The book's models are tiny: one torch thread is as fast as two on an idle machine and does not
# spin-wait against a busy core (chapter 1, "Threads").
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def assert_same_trajectories(trajs, ref):
    """Two lists of Trajectory are the same episodes: ids, masks, rewards, info, log-probs
    (to float rounding)."""
    assert len(trajs) == len(ref)
    for a, b in zip(trajs, ref):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.action_mask, b.action_mask)
        assert torch.allclose(a.sample_logp, b.sample_logp, atol=1e-6, rtol=0)
        assert a.reward == b.reward and a.info == b.info


@pytest.fixture(scope='module')
def tiny_agent():
    """A few train tasks, the book's tokenizer and a small random TinyAgent:
    (tasks, tok, model), for tests of the RL update and loop."""
    import agentrl as arl
    tasks = arl.make_tasks('train')[:12]
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), d_model=32, n_layers=1, n_heads=2)
    return tasks, tok, model
