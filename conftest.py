"""pytest settings for test_all.py: the `cuda` marker (tests that need a GPU: `-m cuda`) and
the `slow` marker (tests that start processes, read the real
checkpoints, kill runs or check parity with a reference tool), so that
`python3 -m pytest test_all.py -q -m "not slow"` is the quick tier."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts processes or reads real checkpoints "
                                       "(deselect with -m 'not slow')")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU, skips without one "
                                       "(run them with -m cuda)")
