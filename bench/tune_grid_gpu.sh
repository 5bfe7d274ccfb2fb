# The issue-17 grid benchmark on a GPU machine (bench/tune_grid.py): the 1.1B set generated there, then the grid.
# Run from the repository root with the pydantic wheels in .whl/ (the image lacks pydantic).
set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; df -h /tmp | tail -1
python3 -c "import torch, pydantic; print(torch.__version__, torch.cuda.is_available(), pydantic.__version__)"
start=$(date +%s); python3 bench/memory.py generate --models /tmp/l1b 2>&1 | tail -2; echo "generate $(( $(date +%s) - start )) s"
python3 bench/tune_grid.py --models /tmp/l1b --work /tmp/gw --device cuda --separate 2 2>&1 | tee $OUT/grid.log
