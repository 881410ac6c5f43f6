"""Everything about the machines a chat runs on: the hostfile (`hostfile`), what each
host has (`probe`, asked over ssh by `facts`), where the layers and the cache go
(`placement`, pure; `plan`, from the gathered facts), the weights fetched onto each
host (`fetch`), the models each holds (`listing`) and the link test between them
(`linktest`, with its rank in `link_main`).

The modules sit at different layers (exokv/layers.py names each): placement and the
hostfile are plain data, the link test starts ranks.
"""
