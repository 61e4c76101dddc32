// Exchange the memory (data pointer and byte size) of two CPU storages in place: the storage objects,
// and so every tensor viewing them, stay the same. chunkmem's block pool (chunkmem/block_pool.py) uses it
// to give a chunk's device copy a cached block and take the block back, where a resize would go
// through malloc. Built against the installed torch's headers and linked to its libc10.

#include <c10/core/StorageImpl.h>

#include <utility>

extern "C" int chunkmem_storage_exchange_abi() { return 1; }

// Returns 0 on success; 1 (nothing changed) unless both are distinct CPU storages.
extern "C" int chunkmem_exchange_storage_memory(void* a, void* b) {
  auto* x = static_cast<c10::StorageImpl*>(a);
  auto* y = static_cast<c10::StorageImpl*>(b);
  if (x == nullptr || y == nullptr || x == y) return 1;
  if (x->device_type() != c10::DeviceType::CPU || y->device_type() != c10::DeviceType::CPU) return 1;
  c10::DataPtr from_y = y->set_data_ptr(c10::DataPtr());
  c10::DataPtr from_x = x->set_data_ptr(std::move(from_y));
  y->set_data_ptr_noswap(std::move(from_x));
  const size_t x_bytes = x->nbytes();
  x->set_nbytes(y->nbytes());
  y->set_nbytes(x_bytes);
  return 0;
}
