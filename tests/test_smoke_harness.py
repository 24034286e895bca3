from tests.harness import simulated_exporter


async def test_node_8gpu_serves_every_gpu_and_attributes_the_time_sliced_pods() -> None:
    async with simulated_exporter("node-8gpu") as h:
        scrape = await h.scrape()
        assert len(scrape.series("gpu_info")) == 8
        chat = {
            labels["pod"]: value
            for labels, value in scrape.find("gpu_container_memory_used_bytes", gpu="2")
        }
        assert chat == {
            "chat-a": (18 * 1024 + 400 * 2) * 2**20,
            "chat-b": (14 * 1024 + 400 * 2) * 2**20,
            "chat-c": (9 * 1024 + 400 * 2) * 2**20,
        }
