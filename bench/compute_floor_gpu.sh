# Issue 23 on a GPU machine: bench/compute_floor.py with --device cuda (the CLIP-B/32 shapes, the Llama-3.2-3B and
# Qwen2-7B down_proj shapes). Run from the repository root with the pydantic wheels in .whl/ (the image lacks it).
set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -c "import torch, scipy, pydantic; print(torch.__version__, torch.version.cuda, scipy.__version__, pydantic.__version__)"
start=$(date +%s); python3 bench/compute_floor.py --device cuda --repeats 3 2>&1 | tee $OUT/floor-gpu-clip.md
echo "clip shapes $(( $(date +%s) - start )) s"
start=$(date +%s); python3 bench/compute_floor.py --device cuda --large --qwen --repeats 2 2>&1 | tee $OUT/floor-gpu-large.md
echo "large shapes $(( $(date +%s) - start )) s"
