# The project's image: the optimizer service, the trainers and the admin/checkpoint
# commands (lookup-table-optimizer, -train, -admin, -checkpoint). memcached runs from its
# own official image. Build from the repository root:
#
#     docker build -t lookup-table:0.1.0 .
#
# See docs/kubernetes.md. The tag is the package version (pyproject.toml) and is the one
# deploy/k8s/ runs; tests/unit/test_k8s.py checks that they agree.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_CPP_MIN_LOG_LEVEL=2

# A fixed numeric uid, so that Kubernetes' runAsNonRoot can check it.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/lookup-table \
        --shell /usr/sbin/nologin lookup-table

WORKDIR /src
# The dependencies first, in a layer of their own (TensorFlow is most of the image): an
# edit of the code reuses it. Empty packages stand in for the code until the next step.
COPY pyproject.toml README.md ./
RUN mkdir lookup_table optimizer_service trainer \
    && touch lookup_table/__init__.py optimizer_service/__init__.py trainer/__init__.py \
    && pip install ".[train]" \
    && pip uninstall -y lookup-table \
    && rm -rf lookup_table optimizer_service trainer build ./*.egg-info

COPY lookup_table ./lookup_table
COPY optimizer_service ./optimizer_service
COPY trainer ./trainer
RUN pip install --no-deps . && rm -rf build ./*.egg-info

USER 10001:10001
WORKDIR /home/lookup-table
# No ENTRYPOINT: every manifest names its command (one image, four programs).
CMD ["lookup-table-optimizer", "--help"]
