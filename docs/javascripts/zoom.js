// A lesson's figure, scaled down to the column, toggles to its full size on click.
document.addEventListener("click", (event) => {
  const img = event.target;
  if (img.matches(".jupyter-wrapper .jp-OutputArea-output img")) {
    img.classList.toggle("zoomed");
  }
});
