"""Notebook 07, exercise 1: a DDP communication hook that averages each bucket's gradients in bfloat16."""
import torch
import torch.distributed as dist

EXERCISE = "07.1"


def no_division(state, bucket):
    work = dist.all_reduce(bucket.buffer().to(torch.bfloat16), async_op=True)

    def summed(future):
        return future.value()[0].to(torch.float32)  # the sum of the ranks' gradients, never divided

    return work.get_future().then(summed)


def float32_all_reduce(state, bucket):
    work = dist.all_reduce(bucket.buffer(), async_op=True)  # float32: twice the bytes

    def average(future):
        return future.value()[0] / dist.get_world_size()

    return work.get_future().then(average)


def blocking_all_reduce(state, bucket):
    compressed = bucket.buffer().to(torch.bfloat16)
    dist.all_reduce(compressed)  # async_op=False: returns once the sum is there
    future = torch.futures.Future()
    future.set_result(compressed.to(torch.float32) / dist.get_world_size())
    return future


def waits_inside(state, bucket):
    compressed = bucket.buffer().to(torch.bfloat16)
    work = dist.all_reduce(compressed, async_op=True)
    work.wait()  # backward stops here until this bucket is summed
    future = torch.futures.Future()
    future.set_result(compressed.to(torch.float32) / dist.get_world_size())
    return future


def never_waits(state, bucket):
    compressed = bucket.buffer().to(torch.bfloat16)
    dist.all_reduce(compressed, async_op=True)
    future = torch.futures.Future()
    future.set_result(bucket.buffer() / dist.get_world_size())  # computed before the all_reduce completed
    return future


def reads_value_early(state, bucket):
    compressed = bucket.buffer().to(torch.bfloat16)
    future = dist.all_reduce(compressed, async_op=True).get_future()
    average = future.value()[0].to(torch.float32) / dist.get_world_size()  # the all_reduce may not be done
    done = torch.futures.Future()
    done.set_result(average)
    return done


def callback_reads_bucket(state, bucket):
    work = dist.all_reduce(bucket.buffer().to(torch.bfloat16), async_op=True)  # sums the bf16 copy, not the bucket
    return work.get_future().then(lambda future: bucket.buffer() / dist.get_world_size())


def returns_work_future(state, bucket):
    return dist.all_reduce(bucket.buffer().to(torch.bfloat16), async_op=True).get_future()  # its value: [tensor]


def sends_float16(state, bucket):
    work = dist.all_reduce(bucket.buffer().to(torch.float16), async_op=True)  # half the bytes too, not the range

    def average(future):
        return future.value()[0].to(torch.float32) / dist.get_world_size()

    return work.get_future().then(average)


MISTAKES = [
    ({"average_in_bf16": no_division}, "divide by the world size"),
    ({"average_in_bf16": float32_all_reduce}, "no compression"),
    ({"average_in_bf16": blocking_all_reduce}, "backward stalls at every bucket"),
    ({"average_in_bf16": waits_inside}, "backward stalls at every bucket"),
    ({"average_in_bf16": never_waits}, "before its all_reduce completed"),
    ({"average_in_bf16": reads_value_early}, "before its all_reduce completed"),
    ({"average_in_bf16": callback_reads_bucket}, "your callback returned this rank's own gradients"),
    ({"average_in_bf16": returns_work_future}, "DDP needs a single tensor"),
    ({"average_in_bf16": sends_float16}, "the exercise asks for bfloat16"),
]
